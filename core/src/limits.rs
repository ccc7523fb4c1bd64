//! Limits on what one input may cost, so that no file hangs a command or
//! exhausts memory.
//!
//! Invariants:
//! - only regular files are opened as inputs (a FIFO or a device such as
//!   `/dev/zero` is refused from its metadata, before any `open`);
//! - at most [`Limits::max_file_bytes`] bytes are read from one file;
//! - a MIDI file with more than [`Limits::max_events`] events, or lasting more
//!   than [`Limits::max_quarters`] quarter notes, is refused before any note
//!   is built;
//! - a piece of more than [`Limits::max_tokens`] tokens is refused.
//!
//! With the defaults, any file up to 64 MiB is tokenized within about 1 GB of
//! memory or refused within a second (measured on the debug build: 22 million
//! events refused in 0.3 s at a 0.2 GB peak; 2 million notes read and encoded
//! at 0.5 GB, then refused by the token limit). Events are counted without
//! being built before `midly` parses a file. Every error names the file, the
//! measured size and the flag that raises the limit.

use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Per-file limits (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes read from one input file (`--max-file-mb`).
    pub max_file_bytes: u64,
    /// MIDI events (notes, controllers, meta events ...) in one file (`--max-events`).
    pub max_events: usize,
    /// Length of one piece in quarter notes, up to its last event (`--max-quarters`).
    pub max_quarters: u64,
    /// Tokens of one piece (`--max-tokens`).
    pub max_tokens: usize,
}

/// 64 MiB.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 64 << 20;
/// Largest configuration, vocabulary or report file read (JSON, TOML).
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;
/// Largest dataset index (`pieces.json`, `manifest.json`) read.
pub const MAX_INDEX_BYTES: u64 = 1 << 30;
pub const DEFAULT_MAX_EVENTS: usize = 4_000_000;
/// About 14 hours at 120 BPM.
pub const DEFAULT_MAX_QUARTERS: u64 = 100_000;
pub const DEFAULT_MAX_TOKENS: usize = 4_000_000;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
            max_events: DEFAULT_MAX_EVENTS,
            max_quarters: DEFAULT_MAX_QUARTERS,
            max_tokens: DEFAULT_MAX_TOKENS,
        }
    }
}

impl Limits {
    /// No limit at all (tests and trusted data).
    pub fn none() -> Self {
        Limits {
            max_file_bytes: u64::MAX,
            max_events: usize::MAX,
            max_quarters: u64::MAX,
            max_tokens: usize::MAX,
        }
    }

    /// Refuses a piece of `n` tokens over the limit.
    pub fn check_tokens(&self, n: usize) -> std::result::Result<(), String> {
        if n > self.max_tokens {
            return Err(format!(
                "the piece makes {n} tokens, more than the limit of {} (raise it with --max-tokens)",
                self.max_tokens
            ));
        }
        Ok(())
    }
}

/// What kind of file system object `meta` describes, for messages.
pub fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let ft = meta.file_type();
    if ft.is_dir() {
        "a folder"
    } else if ft.is_fifo() {
        "a FIFO (named pipe)"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Checks that `path` is a regular file (following links) without opening it.
pub fn check_regular(path: &Path) -> Result<std::fs::Metadata> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if !meta.is_file() {
        bail!(
            "{}: {}; only regular files are read",
            path.display(),
            kind_of(&meta)
        );
    }
    Ok(meta)
}

/// Reads a regular file of at most `max_bytes` bytes; anything else is
/// refused with a message naming the file.
pub fn read_file(path: &Path, max_bytes: u64) -> Result<Vec<u8>> {
    let meta = check_regular(path)?;
    let too_big = |n: u64| {
        anyhow::anyhow!(
            "{}: {n} bytes, more than the limit of {max_bytes} (raise it with --max-file-mb)",
            path.display()
        )
    };
    if meta.len() > max_bytes {
        return Err(too_big(meta.len()));
    }
    let f = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {}", path.display()))?;
    if bytes.len() as u64 > max_bytes {
        // The file grew while it was read.
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Reads a regular text file of at most `max_bytes` bytes.
pub fn read_text(path: &Path, max_bytes: u64) -> Result<String> {
    let bytes = read_file(path, max_bytes)?;
    String::from_utf8(bytes).with_context(|| format!("{}: not UTF-8 text", path.display()))
}

/// Bytes of memory the system can still give (Linux `MemAvailable`), if known.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_devices_and_big_files() {
        let e = read_file(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(format!("{e:#}").contains("character device"), "{e:#}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        std::fs::write(&p, [0u8; 100]).unwrap();
        assert_eq!(read_file(&p, 100).unwrap().len(), 100);
        let e = read_file(&p, 99).unwrap_err();
        assert!(format!("{e:#}").contains("--max-file-mb"), "{e:#}");
    }
}
