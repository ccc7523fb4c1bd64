//! The output policy of every command: what a command may write over.
//!
//! Every command that writes files declares, before its first write, what it
//! reads and what it writes in one [`Plan`] and calls [`Plan::check`]; the
//! atomic writer (`util::write_via_temp`) checks [`check_target`] again right
//! before each rename. The invariants:
//!
//! 1. **An output is a regular file or a new path.** A folder, a character
//!    or block device, a FIFO or a socket found there is refused, naming the
//!    path and what it is, and nothing is ever renamed over it. No output is
//!    placed in `/dev`, `/proc` or `/sys` (`/dev/shm` excepted): renaming
//!    there would replace a system entry such as `/dev/stdout`. No command
//!    writes to standard output through a path, so `-` is refused rather
//!    than made into a file of that name (`./-` writes one).
//! 2. **An output is never a file the command reads.** What a command reads
//!    is every path it was given as an input, and, for an input that is a
//!    folder (a MIDI folder, a dataset, a model or run folder), *every file
//!    that exists under that folder*, whatever its name: the commands read
//!    different files of a run at different times, and a rule that lists
//!    them would miss the next one. Paths are compared by their resolved
//!    form (symbolic links and `..` followed) and, for files that exist, by
//!    (device, inode), which also catches hard links and symbolic links
//!    inside an input folder that point at the output. A new file inside an
//!    input folder destroys nothing and is allowed.
//! 3. **Two outputs of one command are two files.**
//!
//! A file a command itself keeps inside a folder it reads (`eval`'s default
//! `MODEL/eval.png`, `train`'s files in its run folder) is declared with
//! [`Plan::owned`]: rules 1 and 3 and the named inputs of rule 2 still apply,
//! and so does the (device, inode) comparison with the files of the input
//! folders, but its being inside one of them is not refused.
//!
//! Every refusal is an error that names the output, its flag and the input
//! it would destroy; it comes before anything is written.

use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use crate::util::{resolved_path, shown};

/// The folders no output may be placed in (their entries are the system's).
const SYSTEM_FOLDERS: [&str; 3] = ["/dev", "/proc", "/sys"];
/// A folder under [`SYSTEM_FOLDERS`] where writing files is ordinary.
const SYSTEM_EXCEPTIONS: [&str; 1] = ["/dev/shm"];

/// A file found under an input folder: the folder's flag, the folder, the file.
type Found<'a> = (&'a str, &'a Path, PathBuf);

/// What a command reads and writes, checked before its first write (see the
/// module documentation for the rules).
#[derive(Debug, Default, Clone)]
pub struct Plan {
    reads: Vec<(String, PathBuf)>,
    writes: Vec<(String, PathBuf, bool)>,
}

impl Plan {
    /// An empty plan.
    pub fn new() -> Plan {
        Plan::default()
    }

    /// The command reads `path` (a file, or a folder and every file under it),
    /// given by `flag` (the name errors use: `--data`, `input`, ...).
    pub fn read(&mut self, flag: &str, path: &Path) -> &mut Plan {
        self.reads.push((flag.to_string(), path.to_path_buf()));
        self
    }

    /// The command writes the file `path`, given by `flag`.
    pub fn write(&mut self, flag: &str, path: &Path) -> &mut Plan {
        self.writes
            .push((flag.to_string(), path.to_path_buf(), false));
        self
    }

    /// The command writes `path`, a file of its own that may lie inside a
    /// folder it reads (it is still refused when it is a named input, the
    /// same file as one under an input folder, or not a regular file).
    pub fn owned(&mut self, flag: &str, path: &Path) -> &mut Plan {
        self.writes
            .push((flag.to_string(), path.to_path_buf(), true));
        self
    }

    /// Refuses the plan when an output breaks one of the rules; `Ok` when
    /// every output may be written.
    pub fn check(&self) -> Result<()> {
        // What each output is, worked out once: the numbered outputs of a batch share
        // their folder, whose resolution is kept (100,000 pieces are one folder).
        let mut dirs = Dirs::default();
        let outs: Vec<Target> = self
            .writes
            .iter()
            .map(|(flag, out, owned)| {
                let t = Target::of(flag, out, *owned, &mut dirs);
                t.check_kind().map_err(|e| anyhow::anyhow!("{flag} {e}"))?;
                Ok(t)
            })
            .collect::<Result<_>>()?;
        // Named inputs and outputs, keyed by resolved path and (device, inode).
        let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
        let mut by_path: HashMap<PathBuf, (&str, &Path)> = HashMap::new();
        let mut by_id: HashMap<(u64, u64), (&str, &Path)> = HashMap::new();
        let mut folders: Vec<(&str, &Path, PathBuf)> = Vec::new();
        for (flag, p) in &self.reads {
            if std::fs::metadata(p).is_ok_and(|m| m.is_dir()) {
                let canon = p.canonicalize().unwrap_or_else(|_| p.clone());
                folders.push((flag, p, canon));
                continue;
            }
            by_path.insert(resolved_path(p), (flag, p));
            if let Some(k) = id(p) {
                by_id.insert(k, (flag, p));
            }
        }
        // Inputs first (an output that is also another output's twin is
        // reported as the input it would destroy).
        for t in &outs {
            if let Some((iflag, input)) = t.find(&by_path, &by_id) {
                bail!(
                    "{} {} is the input {iflag} {}: refusing to overwrite an input; \
                     choose another output file",
                    t.flag,
                    shown(t.path),
                    shown(input)
                );
            }
        }
        check_folders(&outs, &folders)?;
        by_path.clear();
        by_id.clear();
        for t in &outs {
            if let Some((oflag, other)) = t.find(&by_path, &by_id) {
                bail!(
                    "{} {} and {oflag} {} are the same file: each output needs its own path",
                    t.flag,
                    shown(t.path),
                    shown(other)
                );
            }
            by_path.insert(t.resolved.clone(), (t.flag, t.path));
            if let Some(k) = t.id {
                by_id.insert(k, (t.flag, t.path));
            }
        }
        Ok(())
    }
}

/// Resolved folders, kept for the outputs that share them.
#[derive(Default)]
struct Dirs(HashMap<PathBuf, PathBuf>);

impl Dirs {
    /// `path`'s folder resolved (symbolic links followed), joined with its last name as
    /// given: where a rename to `path` lands. None for a path without a file name.
    fn place(&mut self, path: &Path) -> Option<PathBuf> {
        let name = path.file_name()?;
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let canon = self
            .0
            .entry(dir.to_path_buf())
            .or_insert_with(|| dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf()));
        Some(canon.join(name))
    }
}

/// One output of a [`Plan`] and what [`Plan::check`] needs to know of it.
struct Target<'a> {
    flag: &'a str,
    path: &'a Path,
    owned: bool,
    /// Where its rename lands (None: no file name).
    place: Option<PathBuf>,
    /// What is there now, followed through symbolic links.
    meta: Option<std::fs::Metadata>,
    /// [`resolved_path`] of it.
    resolved: PathBuf,
    id: Option<(u64, u64)>,
}

impl<'a> Target<'a> {
    fn of(flag: &'a str, path: &'a Path, owned: bool, dirs: &mut Dirs) -> Target<'a> {
        let meta = std::fs::metadata(path).ok();
        let place = dirs.place(path);
        // an existing file resolves through its own links; a new one is its place
        let resolved = match (&meta, &place) {
            (None, Some(p)) => p.clone(),
            _ => resolved_path(path),
        };
        let id = meta.as_ref().map(|m| (m.dev(), m.ino()));
        Target {
            flag,
            path,
            owned,
            place,
            meta,
            resolved,
            id,
        }
    }

    /// Rule 1 ([`check_target`]) from what is already known.
    fn check_kind(&self) -> Result<()> {
        kind_rule(self.path, self.place.as_deref(), self.meta.as_ref())
    }

    /// The entry of `by_path` or `by_id` that is this output.
    fn find<'m>(
        &self,
        by_path: &HashMap<PathBuf, (&'m str, &'m Path)>,
        by_id: &HashMap<(u64, u64), (&'m str, &'m Path)>,
    ) -> Option<(&'m str, &'m Path)> {
        by_path
            .get(&self.resolved)
            .or_else(|| self.id.and_then(|k| by_id.get(&k)))
            .copied()
    }
}

/// Rule 2 for folders: refuses an existing output inside an input folder, or the same
/// file as one found under it.
fn check_folders(outs: &[Target], folders: &[(&str, &Path, PathBuf)]) -> Result<()> {
    let existing: Vec<&Target> = outs.iter().filter(|t| t.meta.is_some()).collect();
    if existing.is_empty() || folders.is_empty() {
        return Ok(());
    }
    for t in existing.iter().filter(|t| !t.owned) {
        if let Some((iflag, folder, _)) = folders.iter().find(|(_, _, c)| t.resolved.starts_with(c))
        {
            bail!(
                "{} {} is a file inside the input {iflag} {}, which this command \
                 reads: refusing to overwrite an input; choose a path outside it",
                t.flag,
                shown(t.path),
                shown(folder)
            );
        }
    }
    let mut inside: HashMap<(u64, u64), Vec<Found>> = HashMap::new();
    for (flag, folder, _) in folders {
        walk_ids(folder, &mut |k, found| {
            inside.entry(k).or_default().push((flag, folder, found));
        });
    }
    for t in &existing {
        // The output itself, found in the folder, is not another file.
        let other =
            t.id.and_then(|k| inside.get(&k))
                .and_then(|v| v.iter().find(|(_, _, f)| resolved_path(f) != t.resolved));
        if let Some((iflag, folder, found)) = other {
            bail!(
                "{} {} is the same file as {}, inside the input {iflag} {}: \
                 refusing to overwrite an input; choose another output file",
                t.flag,
                shown(t.path),
                shown(found),
                shown(folder)
            );
        }
    }
    Ok(())
}

/// Calls `f` with the (device, inode) of every file under `dir` (symbolic
/// links to files followed, links to folders not, so a loop cannot hold it).
fn walk_ids(dir: &Path, f: &mut dyn FnMut((u64, u64), PathBuf)) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let Ok(ft) = e.file_type() else { continue };
        if ft.is_dir() {
            walk_ids(&p, f);
        } else if let Ok(m) = std::fs::metadata(&p) {
            if !m.is_dir() {
                f((m.dev(), m.ino()), p);
            }
        }
    }
}

/// What a file that is not a regular file is, for a message.
fn kind(ft: &std::fs::FileType) -> &'static str {
    if ft.is_dir() {
        "a folder"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_fifo() {
        "a FIFO (named pipe)"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Rule 1 for one path: refuses `-`, a place in a system folder, and an
/// existing entry (followed through symbolic links) that is not a regular
/// file. The error starts with the path. [`crate::util::write_via_temp`]
/// calls it before it writes and again before it renames.
pub fn check_target(path: &Path) -> Result<()> {
    let place = Dirs::default().place(path);
    let meta = std::fs::metadata(path).ok();
    kind_rule(path, place.as_deref(), meta.as_ref())
}

/// [`check_target`] given where `path`'s rename lands (`place`, None when it has no
/// file name) and what is there now (`meta`).
fn kind_rule(path: &Path, place: Option<&Path>, meta: Option<&std::fs::Metadata>) -> Result<()> {
    if path.as_os_str() == "-" {
        bail!(
            "-: this command writes files, not standard output; name a file \
             (./- for a file called -)"
        );
    }
    let place = place.ok_or_else(|| anyhow::anyhow!("{} is not a file path", shown(path)))?;
    let in_system = SYSTEM_FOLDERS.iter().any(|s| place.starts_with(s))
        && !SYSTEM_EXCEPTIONS.iter().any(|s| place.starts_with(s));
    if in_system {
        bail!(
            "{} is in a system folder ({}): refusing to write there; choose a regular file",
            shown(path),
            shown(place)
        );
    }
    if let Some(m) = meta {
        if !m.is_file() {
            bail!(
                "{} is {}: an output must be a regular file or a new path; \
                 refusing to write over it",
                shown(path),
                kind(&m.file_type())
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(p: &Plan) -> String {
        format!("{:#}", p.check().unwrap_err())
    }

    #[test]
    fn regular_files_and_new_paths_are_accepted() {
        let tmp = tempfile::tempdir().unwrap();
        let old = tmp.path().join("old.mid");
        std::fs::write(&old, b"x").unwrap();
        let input = tmp.path().join("in.txt");
        std::fs::write(&input, b"x").unwrap();
        Plan::new()
            .read("tokens", &input)
            .write("-o", &old)
            .write("--png", &tmp.path().join("new.png"))
            .check()
            .unwrap();
        check_target(&tmp.path().join("sub-does-not-exist").join("a")).unwrap();
    }

    #[test]
    fn folders_fifos_and_devices_are_refused_by_kind() {
        let tmp = tempfile::tempdir().unwrap();
        let e = err(Plan::new().write("-o", tmp.path()));
        assert!(e.contains("-o") && e.contains("a folder"), "{e}");
        let fifo = tmp.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = err(Plan::new().write("--json", &fifo));
        assert!(e.contains("--json") && e.contains("FIFO"), "{e}");
        // A symbolic link to it is refused the same way.
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&fifo, &link).unwrap();
        let e = err(Plan::new().write("-o", &link));
        assert!(e.contains("FIFO"), "{e}");
        let e = check_target(Path::new("-")).unwrap_err().to_string();
        assert!(e.contains("standard output"), "{e}");
    }

    #[test]
    fn system_folders_are_refused_without_touching_them() {
        for p in ["/dev/stdout", "/dev/null", "/proc/self/x", "/sys/x"] {
            let e = check_target(Path::new(p)).unwrap_err().to_string();
            assert!(e.contains("system folder"), "{p}: {e}");
        }
    }

    #[test]
    fn a_file_inside_an_input_folder_is_refused_a_new_one_is_not() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        std::fs::create_dir_all(run.join("checkpoint")).unwrap();
        let weights = run.join("checkpoint/model.safetensors");
        std::fs::write(&weights, b"w").unwrap();
        let e = err(Plan::new().read("--model", &run).write("-o", &weights));
        assert!(
            e.contains("-o") && e.contains("--model") && e.contains("refusing to overwrite"),
            "{e}"
        );
        // Through `..` and a symbolic link too.
        let other = run.join("checkpoint/../checkpoint/model.safetensors");
        assert!(Plan::new()
            .read("--model", &run)
            .write("-o", &other)
            .check()
            .is_err());
        let link = tmp.path().join("out.mid");
        std::os::unix::fs::symlink(&weights, &link).unwrap();
        assert!(Plan::new()
            .read("--model", &run)
            .write("-o", &link)
            .check()
            .is_err());
        // A hard link outside the folder to a file inside it.
        let hard = tmp.path().join("hard.mid");
        std::fs::hard_link(&weights, &hard).unwrap();
        let e = err(Plan::new().read("--model", &run).write("-o", &hard));
        assert!(e.contains("same file as"), "{e}");
        // A new file inside the folder destroys nothing.
        Plan::new()
            .read("--model", &run)
            .write("-o", &run.join("piece.mid"))
            .check()
            .unwrap();
        // A file of the command's own inside it is allowed, unless it is an input.
        Plan::new()
            .read("--model", &run)
            .owned("--png", &weights.with_file_name("eval.png"))
            .check()
            .unwrap();
        std::fs::write(run.join("eval.png"), b"p").unwrap();
        Plan::new()
            .read("--model", &run)
            .owned("--png", &run.join("eval.png"))
            .check()
            .unwrap();
        // An owned file found by the walk is not "another" file ...
        let corpus = tmp.path();
        Plan::new()
            .read("--data", corpus)
            .owned("-o", &run.join("eval.png"))
            .check()
            .unwrap();
        // ... but a hard link to a file of the folder is.
        let e = err(Plan::new()
            .read("--model", &run)
            .owned("--png", &run.join("../hard.mid")));
        assert!(e.contains("same file as"), "{e}");
    }

    #[test]
    fn named_inputs_and_twin_outputs_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let v = tmp.path().join("v.json");
        std::fs::write(&v, b"{}").unwrap();
        let e = err(Plan::new().read("--vocab", &v).write("-o", &v));
        assert!(e.contains("is the input --vocab"), "{e}");
        let x = tmp.path().join("x");
        let e = err(Plan::new().write("-o", &x).write("--png", &x));
        assert!(e.contains("same file"), "{e}");
    }
}
