//! `GET /files/{name}`: a generated file, streamed.
//!
//! A file is never read whole: the answer's body reads it [`CHUNK`] bytes
//! at a time as the client takes them, so one download holds at most one
//! chunk in memory whatever the file's size, and a client that hangs up
//! (the connection closes, hyper drops the body) stops the reading. One
//! byte range (`bytes=A-B`, `bytes=A-`, `bytes=-N`) gets 206 with just
//! those bytes, so that the audio player can seek; a range past the end
//! gets 416; any other `Range` (several ranges, another unit) is ignored
//! and the whole file is sent, as RFC 9110 allows.
//!
//! "Download all" ([`send_zip`]) streams a zip archive the same way: a
//! blocking thread writes it into a channel of a few chunks that the body
//! drains, and stops when the client hangs up.

use std::io::SeekFrom;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncSeekExt, ReadBuf};

/// Bytes read from the file per body frame.
pub(crate) const CHUNK: usize = 64 * 1024;

/// What a `Range` header asks of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Range {
    /// No usable range: the whole file.
    Whole,
    /// Bytes `a..=b`.
    Part(u64, u64),
    /// A range wholly past the end of the file.
    Unsatisfiable,
}

/// What the `Range` header `spec` asks of a `total`-byte file.
pub(crate) fn byte_range(spec: Option<&str>, total: u64) -> Range {
    let Some(spec) = spec.and_then(|s| s.trim().strip_prefix("bytes=")) else {
        return Range::Whole;
    };
    let Some((a, b)) = spec.trim().split_once('-') else {
        return Range::Whole;
    };
    if b.contains(',') {
        return Range::Whole;
    }
    let number = |s: &str| -> Option<u64> {
        let s = s.trim();
        (!s.is_empty() && s.bytes().all(|c| c.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    match (a.trim(), b.trim()) {
        ("", n) => match number(n) {
            Some(0) => Range::Unsatisfiable,
            Some(_) if total == 0 => Range::Unsatisfiable,
            Some(n) => Range::Part(total.saturating_sub(n), total - 1),
            None => Range::Whole,
        },
        (a, b) => {
            let Some(a) = number(a) else {
                return Range::Whole;
            };
            let b = if b.is_empty() {
                Some(u64::MAX)
            } else {
                number(b)
            };
            match b {
                Some(b) if a > b => Range::Whole,
                Some(_) if a >= total => Range::Unsatisfiable,
                Some(b) => Range::Part(a, b.min(total - 1)),
                None => Range::Whole,
            }
        }
    }
}

/// The MIME type of a studio file, by its extension.
pub(crate) fn content_type(name: &str) -> &'static str {
    match name.rsplit('.').next() {
        Some("wav") => "audio/wav",
        Some("png") => "image/png",
        Some("mid") => "audio/midi",
        Some("json") => "application/json",
        Some("zip") => "application/zip",
        _ => "text/plain; charset=utf-8",
    }
}

/// A body that reads `left` bytes of an open file, a chunk per frame.
struct FileBody {
    file: tokio::fs::File,
    left: u64,
    buf: Vec<u8>,
}

impl http_body::Body for FileBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = self.get_mut();
        if this.left == 0 {
            return Poll::Ready(None);
        }
        let want = (this.left.min(CHUNK as u64)) as usize;
        this.buf.resize(want, 0);
        let mut rb = ReadBuf::new(&mut this.buf[..want]);
        ready!(Pin::new(&mut this.file).poll_read(cx, &mut rb))?;
        let got = rb.filled().len();
        if got == 0 {
            // The file shrank after its length was sent: end the answer
            // with an error rather than a short body that looks complete.
            return Poll::Ready(Some(Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the file became shorter while it was being sent",
            ))));
        }
        this.left -= got as u64;
        Poll::Ready(Some(Ok(Frame::data(Bytes::copy_from_slice(rb.filled())))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left)
    }
}

/// The answer to a download of `path` (served as `name`) with this `Range`
/// header; `Err` when the file cannot be opened.
pub(crate) async fn send(
    path: std::path::PathBuf,
    name: &str,
    range: Option<&str>,
) -> std::io::Result<Response> {
    let mut file = tokio::fs::File::open(&path).await?;
    let total = file.metadata().await?.len();
    let kind = content_type(name);
    let accept = (header::ACCEPT_RANGES, "bytes");
    let (status, start, len, content_range) = match byte_range(range, total) {
        Range::Whole => (StatusCode::OK, 0, total, None),
        Range::Part(a, b) => (
            StatusCode::PARTIAL_CONTENT,
            a,
            b - a + 1,
            Some(format!("bytes {a}-{b}/{total}")),
        ),
        Range::Unsatisfiable => {
            return Ok((
                StatusCode::RANGE_NOT_SATISFIABLE,
                [accept, (header::CONTENT_TYPE, kind)],
                [(header::CONTENT_RANGE, format!("bytes */{total}"))],
            )
                .into_response())
        }
    };
    if start > 0 {
        file.seek(SeekFrom::Start(start)).await?;
    }
    let body = Body::new(FileBody {
        file,
        left: len,
        buf: Vec::new(),
    });
    let mut r = (status, [accept, (header::CONTENT_TYPE, kind)], body).into_response();
    if let Some(cr) = content_range {
        if let Ok(v) = cr.parse() {
            r.headers_mut().insert(header::CONTENT_RANGE, v);
        }
    }
    Ok(r)
}

/// A body fed by a writer on a blocking thread, `left` bytes long.
struct ChannelBody {
    rx: tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>,
    left: u64,
}

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = self.get_mut();
        match ready!(this.rx.poll_recv(cx)) {
            Some(Ok(b)) => {
                this.left = this.left.saturating_sub(b.len() as u64);
                Poll::Ready(Some(Ok(Frame::data(b))))
            }
            Some(Err(e)) => Poll::Ready(Some(Err(e))),
            None => Poll::Ready(None),
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left)
    }
}

/// The writing end of a [`ChannelBody`]: each write waits until the client
/// has taken enough (the channel holds [`QUEUED`] chunks), and fails with
/// `BrokenPipe` once the client is gone.
struct ChannelWriter(tokio::sync::mpsc::Sender<std::io::Result<Bytes>>);

/// Chunks a streamed archive keeps waiting for the client.
const QUEUED: usize = 4;

impl std::io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::ErrorKind::BrokenPipe.into())
            .map(|()| buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A zip archive of `files` (name inside, path), downloaded as `download`:
/// measured first, then written while it is sent ([`super::zip`]); memory
/// stays at a few chunks whatever the files' sizes.
pub(crate) async fn send_zip(
    files: Vec<(String, std::path::PathBuf)>,
    download: &str,
) -> std::io::Result<Response> {
    let (entries, total) = tokio::task::spawn_blocking(move || super::zip::plan(files))
        .await
        .map_err(std::io::Error::other)??;
    let (tx, rx) = tokio::sync::mpsc::channel(QUEUED);
    tokio::task::spawn_blocking(move || {
        let fail = tx.clone();
        let mut w = std::io::BufWriter::with_capacity(CHUNK, ChannelWriter(tx));
        let done = super::zip::write(&entries, &mut w).and_then(|()| {
            use std::io::Write;
            w.flush()
        });
        if let Err(e) = done {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                tracing::warn!("zip archive cut short: {e}");
                let _ = fail.blocking_send(Err(e));
            }
        }
    });
    let disposition = format!("attachment; filename=\"{download}\"");
    let mut r = (
        [(header::CONTENT_TYPE, "application/zip")],
        Body::new(ChannelBody { rx, left: total }),
    )
        .into_response();
    if let Ok(v) = disposition.parse() {
        r.headers_mut().insert(header::CONTENT_DISPOSITION, v);
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::{byte_range, Range::*};

    #[test]
    fn byte_ranges() {
        let r = |s: &str, total| byte_range(Some(s), total);
        assert_eq!(r("bytes=0-", 10), Part(0, 9));
        assert_eq!(r("bytes=2-4", 10), Part(2, 4));
        assert_eq!(r("bytes=2-40", 10), Part(2, 9));
        assert_eq!(r("bytes=-3", 10), Part(7, 9));
        assert_eq!(r("bytes=-30", 10), Part(0, 9));
        assert_eq!(r("bytes=10-", 10), Unsatisfiable);
        assert_eq!(r("bytes=-0", 10), Unsatisfiable);
        assert_eq!(r("bytes=0-", 0), Unsatisfiable);
        assert_eq!(r("bytes=5-2", 10), Whole);
        assert_eq!(r("bytes=0-1,4-5", 10), Whole);
        assert_eq!(r("items=0-1", 10), Whole);
        assert_eq!(r("bytes=x-1", 10), Whole);
        assert_eq!(r("bytes=+1-2", 10), Whole);
        assert_eq!(r("bytes=99999999999999999999-", 10), Whole);
        assert_eq!(byte_range(None, 10), Whole);
    }
}
