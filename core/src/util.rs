//! Small helpers shared by every stage.
//!
//! Files are written atomically (a temporary `.NAME.<pid>.tmp` in the same
//! folder, then a rename); the temporary file is removed when writing fails,
//! and [`clean_stale_temps`] removes those left by killed processes.
//! What a command may write over is the output policy of [`crate::output`]:
//! [`write_via_temp`] refuses, before writing and again before its rename,
//! a target that is not a regular file or a new path, and [`check_outputs`]
//! is the policy's check for a command's named inputs and outputs.
//! [`excerpt`] and [`shown`] are how error and log lines quote input (a
//! token, a file name): bounded, with control characters escaped, so that
//! one bad input can neither fill stderr nor forge a log line.

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

/// The opposite of [`quiet_on_broken_pipe`], for a server (`cadenza serve`):
/// SIGPIPE ignored, so that a client that hangs up in the middle of an
/// answer makes that one write fail with `EPIPE` (and its connection end)
/// instead of killing the whole process. Process-wide, like every signal
/// action; call it before the server starts.
pub fn ignore_broken_pipe() {
    #[cfg(unix)]
    // SAFETY: SIG_IGN is a valid action; changing it is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
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
///
/// A target that exists and is not a regular file (a folder, a device, a
/// FIFO, a socket) or lies in a system folder is refused before anything is
/// written and again right before the rename ([`crate::output::check_target`]),
/// so nothing is ever renamed over it. The temporary file is made fresh
/// (`O_EXCL`, after removing a leftover of the same name), so a FIFO or a
/// link planted under its name is never opened.
pub fn write_via_temp(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temp_path(path)?;
    crate::output::check_target(path)?;
    if std::fs::symlink_metadata(&tmp).is_ok() {
        std::fs::remove_file(&tmp).with_context(|| format!("cannot remove {}", shown(&tmp)))?;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .with_context(|| format!("cannot create {}", shown(&tmp)))?;
    let written = write(&tmp).and_then(|_| {
        crate::output::check_target(path)?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("cannot move {} to {}", shown(&tmp), shown(path)))
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

/// Whether process `pid` is alive (Linux `/proc`; a zombie is not); `None` where unknown.
pub fn pid_alive(pid: u32) -> Option<bool> {
    if !Path::new("/proc/self").exists() {
        return None;
    }
    let stat = Path::new("/proc").join(pid.to_string()).join("stat");
    match std::fs::read_to_string(stat) {
        Ok(text) => Some(!stat_is_zombie(&text)),
        Err(_) => Some(false),
    }
}

/// Whether a `/proc/PID/stat` line is that of a zombie (state `Z`: exited, not yet
/// reaped; a container whose init does not reap keeps them, e.g. the ranks of an
/// `mpirun` that was ended). The state follows the last `)` (the name may hold any).
fn stat_is_zombie(stat: &str) -> bool {
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next())
        .is_some_and(|c| c == 'Z' || c == 'X')
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

/// Refuses a command whose output would replace one of its inputs (a named
/// file, or any existing file under an input folder), whose outputs would
/// replace one another, or whose output is not a regular file or a new path:
/// [`crate::output::Plan`] with these inputs and outputs. Each path comes
/// with the flag that gave it, for the message.
pub fn check_outputs(inputs: &[(&str, &Path)], outputs: &[(&str, &Path)]) -> Result<()> {
    let mut plan = crate::output::Plan::new();
    for &(flag, p) in inputs {
        plan.read(flag, p);
    }
    for &(flag, p) in outputs {
        plan.write(flag, p);
    }
    plan.check()
}

/// The most characters of an error line the binaries print (the rest is
/// cut by [`excerpt`]).
pub const MAX_ERROR_CHARS: usize = 4000;

/// The longest file name [`shown`] quotes whole, in characters.
pub const MAX_SHOWN_PATH: usize = 300;

/// `text` as an error or log line may quote it: control characters (a
/// newline that would start a forged line, a terminal escape) and the
/// Unicode controls that reorder text are escaped (`\n`, `\u{1b}`), and
/// past `max` characters the rest is cut, with an ellipsis and the total
/// length in bytes (`abc… (52428800 bytes)`).
pub fn excerpt(text: &str, max: usize) -> String {
    let mut out = String::new();
    let mut shown_chars = 0usize;
    for c in text.chars() {
        let piece = match c {
            '\n' => "\\n".to_string(),
            '\r' => "\\r".to_string(),
            '\t' => "\\t".to_string(),
            c if c.is_control()
                || ('\u{202a}'..='\u{202e}').contains(&c)
                || ('\u{2066}'..='\u{2069}').contains(&c) =>
            {
                c.escape_unicode().to_string()
            }
            c => c.to_string(),
        };
        let n = piece.chars().count();
        if shown_chars + n > max {
            out.push_str(&format!("… ({} bytes)", text.len()));
            return out;
        }
        shown_chars += n;
        out.push_str(&piece);
    }
    out
}

/// A path as an error or log line quotes it: [`excerpt`] of its text, at
/// most [`MAX_SHOWN_PATH`] characters.
pub fn shown(path: &Path) -> String {
    excerpt(&path.to_string_lossy(), MAX_SHOWN_PATH)
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

/// Slots of the paths [`RemoveOnSignal`] guards; a null slot is free.
#[cfg(unix)]
static SIGNAL_PATHS: [std::sync::atomic::AtomicPtr<libc::c_char>; 16] =
    [const { std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()) }; 16];

/// Removes every guarded path, then stops the process by `sig` with its
/// default action (the exit status a shell expects). Only async-signal-safe
/// calls: `unlink`, `signal`, `raise`.
#[cfg(unix)]
extern "C" fn remove_and_reraise(sig: libc::c_int) {
    use std::sync::atomic::Ordering;
    for slot in &SIGNAL_PATHS {
        let p = slot.load(Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: `p` is a NUL-terminated string that is never freed.
            unsafe { libc::unlink(p) };
        }
    }
    // SAFETY: restoring the default action and raising the signal again.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// Installs [`remove_and_reraise`] for SIGINT and SIGTERM, once, where the
/// signal still has its default action: a program that handles them itself
/// (`train` saves and stops on Ctrl-C) or ignores them keeps its choice, and
/// its temporary files are removed as it unwinds.
#[cfg(unix)]
fn install_signal_cleanup() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: sigaction with a zeroed struct reads the current
            // action; the new one is a plain handler with an empty mask.
            unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, std::ptr::null(), &mut old) != 0
                    || old.sa_sigaction != libc::SIG_DFL
                {
                    continue;
                }
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = remove_and_reraise as extern "C" fn(libc::c_int) as usize;
                libc::sigemptyset(&mut act.sa_mask);
                act.sa_flags = libc::SA_RESTART;
                libc::sigaction(sig, &act, std::ptr::null_mut());
            }
        }
    });
}

/// While alive, the files it names are removed when SIGINT or SIGTERM stops
/// the process (`tokenize`'s temporary files, which a killed process would
/// otherwise leave behind until [`clean_stale_temps`] finds them). Dropping
/// it stops guarding them (it removes nothing itself). At most 16 paths are
/// guarded at a time; past that a path is left to [`clean_stale_temps`].
pub struct RemoveOnSignal {
    #[cfg(unix)]
    slots: Vec<usize>,
}

impl RemoveOnSignal {
    /// Guards `paths` (which need not exist yet).
    pub fn new(paths: &[PathBuf]) -> RemoveOnSignal {
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStrExt;
            use std::sync::atomic::Ordering;
            install_signal_cleanup();
            let mut slots = Vec::new();
            for p in paths {
                let Ok(c) = std::ffi::CString::new(p.as_os_str().as_bytes()) else {
                    continue;
                };
                // Leaked on purpose: a handler may read it at any time, so it
                // is never freed (a few bytes per guarded file).
                let ptr = c.into_raw();
                let free = SIGNAL_PATHS.iter().position(|s| {
                    s.compare_exchange(
                        std::ptr::null_mut(),
                        ptr,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    )
                    .is_ok()
                });
                match free {
                    Some(i) => slots.push(i),
                    None => {
                        // SAFETY: `ptr` came from `into_raw` and no slot holds it.
                        drop(unsafe { std::ffi::CString::from_raw(ptr) });
                    }
                }
            }
            RemoveOnSignal { slots }
        }
        #[cfg(not(unix))]
        {
            let _ = paths;
            RemoveOnSignal {}
        }
    }
}

impl Drop for RemoveOnSignal {
    fn drop(&mut self) {
        #[cfg(unix)]
        for &i in &self.slots {
            SIGNAL_PATHS[i].store(std::ptr::null_mut(), std::sync::atomic::Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zombies_are_not_alive() {
        assert!(stat_is_zombie("10568 (cadenza-torch) Z 1 10568"));
        assert!(!stat_is_zombie("10564 (a) Z) S 8452 10564"));
        assert!(!stat_is_zombie("1 (init) S 0 1"));
        assert_eq!(pid_alive(std::process::id()), Some(true));
    }

    #[test]
    fn excerpts_are_bounded_and_escape_control_characters() {
        assert_eq!(excerpt("Pitch_60", 64), "Pitch_60");
        assert_eq!(excerpt("a\nERROR forged", 64), "a\\nERROR forged");
        assert_eq!(excerpt("\u{1b}[31mred\r\t", 64), "\\u{1b}[31mred\\r\\t");
        assert_eq!(excerpt("\u{202e}txt", 64), "\\u{202e}txt");
        let big = "x".repeat(50 << 20);
        let e = excerpt(&big, 40);
        assert!(e.len() < 80, "{e}");
        assert!(
            e.starts_with(&"x".repeat(40)) && e.ends_with("… (52428800 bytes)"),
            "{e}"
        );
        // The cut never splits a character or an escape.
        assert_eq!(excerpt("ééé\n", 3), "ééé… (7 bytes)");
        assert_eq!(excerpt("ab\ncd", 3), "ab… (5 bytes)");
        let p = Path::new("dir/a\nb.mid");
        assert_eq!(shown(p), "dir/a\\nb.mid");
        assert!(shown(Path::new(&"d/".repeat(1000))).len() < MAX_SHOWN_PATH + 40);
    }

    #[test]
    fn write_via_temp_never_opens_a_planted_temporary() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out.json");
        // A link planted under the temporary's name, pointing at a victim.
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        std::os::unix::fs::symlink(&victim, temp_path(&out).unwrap()).unwrap();
        write_atomic(&out, b"new").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        assert_eq!(std::fs::read(&out).unwrap(), b"new");
        assert!(!temp_path(&out).unwrap().exists());
    }

    #[test]
    fn guarded_paths_take_and_free_their_slots() {
        let tmp = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> = (0..3).map(|i| tmp.path().join(format!("t{i}"))).collect();
        let taken = |p: &Path| {
            SIGNAL_PATHS.iter().any(|s| {
                let q = s.load(std::sync::atomic::Ordering::SeqCst);
                // SAFETY: non-null slots hold leaked NUL-terminated strings.
                !q.is_null()
                    && unsafe { std::ffi::CStr::from_ptr(q) }.to_bytes()
                        == p.to_str().unwrap().as_bytes()
            })
        };
        let g = RemoveOnSignal::new(&paths);
        assert!(paths.iter().all(|p| taken(p)));
        drop(g);
        assert!(paths.iter().all(|p| !taken(p)));
    }
}
