//! "Download all": a piece's (or a job's) files as one zip archive, written
//! as it is sent.
//!
//! Our own writer rather than the `zip` crate: the archive is streamed to
//! the client while it is made, and `zip`'s writer needs a seekable output
//! (it goes back to fill in each entry's sizes) unless it writes data
//! descriptors, which some readers of stored entries refuse. The files are
//! local and small, so this writer reads each file twice instead: once for
//! its CRC-32 ([`plan`]), once to send it ([`write`]). Every size is then
//! known before the first byte, the headers need no descriptors, and the
//! answer has an exact `Content-Length`.
//!
//! The format (PKWARE APPNOTE 6.3): for each file a local header and the
//! bytes stored as they are (method 0, no compression: WAV and MIDI hardly
//! shrink), then the central directory and its end record. No ZIP64: an
//! archive whose offsets or sizes pass 4 GiB is refused. Names are UTF-8
//! (flag bit 11); times are the files' modification times, in UTC.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

/// One file of an archive, measured by [`plan`].
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// The name inside the archive.
    pub name: String,
    pub path: PathBuf,
    size: u32,
    crc: u32,
    /// MS-DOS time and date.
    time: u16,
    date: u16,
}

/// Sizes of the fixed parts of the records.
const LOCAL: u64 = 30;
const CENTRAL: u64 = 46;
const END: u64 = 22;
/// Version needed to extract: 2.0 (stored entries, folders).
const VERSION: u16 = 20;
/// Bit 11: names are UTF-8.
const FLAGS: u16 = 1 << 11;
const BUF: usize = 64 * 1024;

fn too_big(what: &str) -> std::io::Error {
    std::io::Error::other(format!(
        "{what} is larger than 4 GiB, more than a zip archive without ZIP64 holds"
    ))
}

/// Measures the files (size, CRC-32, time); `(entries, archive length)`.
pub(crate) fn plan(files: Vec<(String, PathBuf)>) -> std::io::Result<(Vec<Entry>, u64)> {
    let mut entries = Vec::with_capacity(files.len());
    let mut total = END;
    for (name, path) in files {
        let mut f = std::fs::File::open(&path)?;
        let meta = f.metadata()?;
        let mut crc = crc32fast::Hasher::new();
        let mut buf = vec![0u8; BUF];
        let mut size = 0u64;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            crc.update(&buf[..n]);
            size += n as u64;
        }
        let size = u32::try_from(size).map_err(|_| too_big(&name))?;
        let (time, date) = dos_time(meta.modified().unwrap_or(UNIX_EPOCH));
        total += LOCAL + CENTRAL + 2 * name.len() as u64 + u64::from(size);
        entries.push(Entry {
            name,
            path,
            size,
            crc: crc.finalize(),
            time,
            date,
        });
    }
    if total > u64::from(u32::MAX) {
        return Err(too_big("the archive"));
    }
    if entries.len() > usize::from(u16::MAX) {
        return Err(std::io::Error::other("too many files for one zip archive"));
    }
    Ok((entries, total))
}

fn u16le(w: &mut impl Write, v: u16) -> std::io::Result<()> {
    w.write_all(&v.to_le_bytes())
}

fn u32le(w: &mut impl Write, v: u32) -> std::io::Result<()> {
    w.write_all(&v.to_le_bytes())
}

/// The fields a local header and its central directory record share, from
/// "version needed" to the extra field's length: stored (no compression),
/// sizes known up front, no extra field.
fn entry_fields(w: &mut impl Write, e: &Entry) -> std::io::Result<()> {
    u16le(w, VERSION)?;
    u16le(w, FLAGS)?;
    u16le(w, 0)?; // stored
    u16le(w, e.time)?;
    u16le(w, e.date)?;
    u32le(w, e.crc)?;
    u32le(w, e.size)?;
    u32le(w, e.size)?;
    u16le(w, e.name.len() as u16)?;
    u16le(w, 0) // no extra field
}

/// Writes the archive of `entries` (as [`plan`] measured them) to `w`. A
/// file that changed since it was measured is an error, never a corrupt
/// archive sent as if it were whole.
pub(crate) fn write(entries: &[Entry], w: &mut impl Write) -> std::io::Result<()> {
    let mut offsets = Vec::with_capacity(entries.len());
    let mut at = 0u64;
    let mut buf = vec![0u8; BUF];
    for e in entries {
        offsets.push(at as u32);
        u32le(w, 0x0403_4b50)?;
        entry_fields(w, e)?;
        w.write_all(e.name.as_bytes())?;
        let mut f = std::fs::File::open(&e.path)?.take(u64::from(e.size) + 1);
        let mut crc = crc32fast::Hasher::new();
        let mut sent = 0u64;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            sent += n as u64;
            if sent > u64::from(e.size) {
                break;
            }
            crc.update(&buf[..n]);
            w.write_all(&buf[..n])?;
        }
        if sent != u64::from(e.size) || crc.finalize() != e.crc {
            return Err(std::io::Error::other(format!(
                "{} changed while the archive was being sent",
                e.name
            )));
        }
        at += LOCAL + e.name.len() as u64 + u64::from(e.size);
    }
    let directory_at = at;
    for (e, &offset) in entries.iter().zip(&offsets) {
        u32le(w, 0x0201_4b50)?;
        u16le(w, VERSION)?; // made by: MS-DOS attributes, version 2.0
        entry_fields(w, e)?;
        u16le(w, 0)?; // comment
        u16le(w, 0)?; // disk
        u16le(w, 0)?; // internal attributes
        u32le(w, 0)?; // external attributes
        u32le(w, offset)?;
        w.write_all(e.name.as_bytes())?;
        at += CENTRAL + e.name.len() as u64;
    }
    let n = entries.len() as u16;
    u32le(w, 0x0605_4b50)?;
    u16le(w, 0)?;
    u16le(w, 0)?;
    u16le(w, n)?;
    u16le(w, n)?;
    u32le(w, (at - directory_at) as u32)?;
    u32le(w, directory_at as u32)?;
    u16le(w, 0)?; // comment
    w.flush()
}

/// MS-DOS `(time, date)` of a moment, in UTC; 1980-01-01 for earlier ones
/// (the format starts there).
fn dos_time(t: SystemTime) -> (u16, u16) {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (y, m, d) = civil_date(secs / 86_400);
    if y < 1980 {
        return (0, (1 << 5) | 1);
    }
    let y = y.min(2107);
    let s = secs % 86_400;
    let time = ((s / 3600) << 11) | (((s / 60) % 60) << 5) | ((s % 60) / 2);
    let date = ((y - 1980) << 9) | (m << 5) | d;
    (time as u16, date as u16)
}

/// `(year, month 1-12, day 1-31)` of a count of days since 1970-01-01: the
/// proleptic Gregorian calendar, counted in 400-year eras (146,097 days
/// each) starting on 1 March, so that the leap day ends a year.
fn civil_date(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z / 146_097;
    let doe = z % 146_097; // day of the era
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365; // year of the era
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the year, from 1 March
    let mp = (5 * doy + 2) / 153; // month, March = 0
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = era * 400 + yoe + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le16(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes([b[at], b[at + 1]])
    }
    fn le32(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn dates_are_those_of_the_calendar() {
        assert_eq!(civil_date(0), (1970, 1, 1));
        assert_eq!(civil_date(11_016), (2000, 2, 29));
        assert_eq!(civil_date(11_017), (2000, 3, 1));
        assert_eq!(civil_date(19_723), (2024, 1, 1));
        assert_eq!(civil_date(20_788), (2026, 12, 1));
        // 2026-12-02 13:45:10 UTC
        let t = UNIX_EPOCH + std::time::Duration::from_secs(1_796_219_110);
        let (time, date) = dos_time(t);
        assert_eq!((date >> 9, (date >> 5) & 15, date & 31), (46, 12, 2));
        assert_eq!(
            (time >> 11, (time >> 5) & 63, (time & 31) * 2),
            (13, 45, 10)
        );
        assert_eq!(dos_time(UNIX_EPOCH), (0, 33));
    }

    #[test]
    fn an_archive_lists_every_file_with_its_bytes_and_crc() {
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<(String, PathBuf)> = [
            ("a.mid", b"MThd-bytes".to_vec()),
            ("b.wav", vec![7u8; 200_000]),
            ("é.txt", Vec::new()),
        ]
        .into_iter()
        .map(|(n, b)| {
            let p = dir.path().join(n);
            std::fs::write(&p, b).unwrap();
            (n.to_string(), p)
        })
        .collect();
        let (entries, total) = plan(files.clone()).unwrap();
        let mut out = Vec::new();
        write(&entries, &mut out).unwrap();
        assert_eq!(out.len() as u64, total);
        // End record -> central directory -> each local header and its bytes.
        let end = out.len() - 22;
        assert_eq!(le32(&out, end), 0x0605_4b50);
        assert_eq!(le16(&out, end + 10), 3);
        let mut at = le32(&out, end + 16) as usize;
        assert_eq!(at + le32(&out, end + 12) as usize, end);
        for (name, path) in &files {
            let bytes = std::fs::read(path).unwrap();
            assert_eq!(le32(&out, at), 0x0201_4b50);
            let n = le16(&out, at + 28) as usize;
            assert_eq!(&out[at + 46..at + 46 + n], name.as_bytes());
            assert_eq!(le32(&out, at + 16), crc32fast::hash(&bytes));
            assert_eq!(le32(&out, at + 24) as usize, bytes.len());
            let local = le32(&out, at + 42) as usize;
            assert_eq!(le32(&out, local), 0x0403_4b50);
            assert_eq!(le16(&out, local + 8), 0, "stored");
            let data = local + 30 + le16(&out, local + 26) as usize;
            assert_eq!(&out[data..data + bytes.len()], &bytes[..]);
            at += 46 + n;
        }
    }

    #[test]
    fn a_file_changed_after_planning_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.mid");
        std::fs::write(&p, b"first").unwrap();
        let (entries, _) = plan(vec![("a.mid".into(), p.clone())]).unwrap();
        std::fs::write(&p, b"other").unwrap();
        let e = write(&entries, &mut Vec::new()).unwrap_err();
        assert!(e.to_string().contains("changed"), "{e}");
        std::fs::write(&p, b"longer than before").unwrap();
        assert!(write(&entries, &mut Vec::new()).is_err());
    }
}
