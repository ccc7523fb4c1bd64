//! Small helpers shared by every stage.
//!
//! Files are written atomically (a temporary `.NAME.<pid>.tmp` in the same
//! folder, then a rename); the temporary file is removed when writing fails,
//! and [`clean_stale_temps`] removes those left by killed processes.
//! [`check_outputs`] keeps a command from writing over its own inputs or
//! writing two outputs to one file.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// Lets a command end quietly, as `cat` or `grep` do, when the reader of
/// its standard output goes away (`cadenza generate ... | head -1`). Rust
/// ignores SIGPIPE, so every later `println!` would panic on the broken
/// pipe; with the default action restored the process ends at the first
/// such write instead. Files being written atomically are never renamed
/// into place half-written: the temporary file stays and is cleaned up by
/// [`clean_stale_temps`]. Call it first thing in `main`.
pub fn quiet_on_broken_pipe() {
    #[cfg(unix)]
    // SAFETY: called before any thread starts; SIG_DFL is a valid action.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a
/// rename, so that a reader never sees a half-written file.
/// The folder is created when missing.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_via_temp(path, |tmp| {
        let mut f = std::fs::File::create(tmp)
            .with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(bytes)
            .and_then(|_| f.sync_all())
            .with_context(|| format!("cannot write {}", tmp.display()))
    })
}

/// Lets `write` fill a temporary file (`.NAME.<pid>.tmp` next to `path`), then
/// renames it to `path`. On any error the temporary file is removed and
/// `path` is left as it was. The folder must exist.
pub fn write_via_temp(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temp_path(path)?;
    if path.is_dir() {
        anyhow::bail!("{} is a folder, not a file", path.display());
    }
    let written = write(&tmp).and_then(|_| {
        std::fs::rename(&tmp, path)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), path.display()))
    });
    if written.is_err() {
        std::fs::remove_file(&tmp).ok();
    }
    written
}

/// The temporary file this process writes `path` through: `.NAME.<pid>.tmp` in
/// the same folder (a rename then puts it in place; [`clean_stale_temps`]
/// knows the name).
pub fn temp_path(path: &Path) -> Result<PathBuf> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .with_context(|| format!("{} is not a file path", path.display()))?;
    Ok(dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    )))
}

thread_local! {
    static QUIET_PANICS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, turning a panic inside it (a third-party library failing on
/// corrupt data) into `Err(message)`. The panic is not printed: the caller
/// reports it as an error that names the file.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET_PANICS.with(|q| q.get()) {
                previous(info);
            }
        }));
    });
    let was = QUIET_PANICS.with(|q| q.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET_PANICS.with(|q| q.set(was));
    r.map_err(|e| {
        e.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| e.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into())
    })
}

/// Whether process `pid` is alive (Linux `/proc`); `None` where unknown.
pub fn pid_alive(pid: u32) -> Option<bool> {
    if !Path::new("/proc/self").exists() {
        return None;
    }
    Some(Path::new("/proc").join(pid.to_string()).exists())
}

/// The pid in a temporary name this crate writes (`.NAME.<pid>.tmp`,
/// `.NAME.tmp-<pid>`), if `name` is one.
fn temp_pid(name: &str) -> Option<u32> {
    if !name.starts_with('.') {
        return None;
    }
    if let Some(rest) = name.strip_suffix(".tmp") {
        return rest.rsplit('.').next()?.parse().ok();
    }
    name.rsplit_once(".tmp-")?.1.parse().ok()
}

/// Removes temporary files and folders in `dir` left by processes that are
/// no longer alive (killed while writing). Returns what was removed.
pub fn clean_stale_temps(dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return removed;
    };
    let me = std::process::id();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = temp_pid(&name) else {
            continue;
        };
        if pid == me || pid_alive(pid) != Some(false) {
            continue;
        }
        let p = e.path();
        let ok = if p.is_dir() {
            std::fs::remove_dir_all(&p).is_ok()
        } else {
            std::fs::remove_file(&p).is_ok()
        };
        if ok {
            removed.push(p);
        }
    }
    removed
}

/// Where `path` is or would be written: the canonical form of its folder
/// joined with its name (the file itself need not exist).
pub fn resolved_path(path: &Path) -> PathBuf {
    if let Ok(p) = path.canonicalize() {
        return p;
    }
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    match (dir.canonicalize(), path.file_name()) {
        (Ok(d), Some(n)) => d.join(n),
        _ => path.to_path_buf(),
    }
}

/// Whether two paths name the same file: the same resolved path, or (for
/// files that exist) the same device and inode, as hard links do.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if resolved_path(a) == resolved_path(b) {
        return true;
    }
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Refuses a command whose output would replace one of its inputs, or whose
/// outputs would replace one another. Each path comes with the flag that gave
/// it, for the message.
pub fn check_outputs(inputs: &[(&str, &Path)], outputs: &[(&str, &Path)]) -> Result<()> {
    use std::collections::HashMap;
    use std::os::unix::fs::MetadataExt;
    // Key by resolved path and, for files that exist, by (device, inode).
    let keys = |p: &Path| {
        let id = std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
        (resolved_path(p), id)
    };
    let mut by_path: HashMap<PathBuf, (bool, &str, &Path)> = HashMap::new();
    let mut by_id: HashMap<(u64, u64), (bool, &str, &Path)> = HashMap::new();
    for &(flag, p) in inputs {
        let (r, id) = keys(p);
        by_path.insert(r, (true, flag, p));
        if let Some(id) = id {
            by_id.insert(id, (true, flag, p));
        }
    }
    for &(flag, out) in outputs {
        let (r, id) = keys(out);
        let hit = by_path
            .get(&r)
            .or_else(|| id.and_then(|id| by_id.get(&id)))
            .copied();
        match hit {
            Some((true, iflag, input)) => anyhow::bail!(
                "{flag} {} is the input {iflag} {}: refusing to overwrite an input; \
                 choose another output file",
                out.display(),
                input.display()
            ),
            Some((false, oflag, other)) => anyhow::bail!(
                "{flag} {} and {oflag} {} are the same file: each output needs its own path",
                out.display(),
                other.display()
            ),
            None => {}
        }
        by_path.insert(r, (false, flag, out));
        if let Some(id) = id {
            by_id.insert(id, (false, flag, out));
        }
    }
    Ok(())
}

/// Writes `value` as pretty JSON (with a final newline), atomically.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let mut bytes = serde_json::to_vec_pretty(value)?;
    bytes.push(b'\n');
    write_atomic(path, &bytes)
}

/// Reads a JSON file; errors name the file.
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = crate::limits::read_text(path, crate::limits::MAX_CONFIG_BYTES)?;
    serde_json::from_str(&text).with_context(|| format!("{}: unexpected content", path.display()))
}
