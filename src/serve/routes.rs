//! The HTTP side: the page's three files and a small JSON API.
//!
//! - `GET /`, `/app.js`, `/app.css`: the page (embedded in the binary);
//! - `GET /api/info`: the model, the limits, the sample prompts, the defaults;
//! - `POST /api/prompts?name=FILE.mid` (body: the MIDI bytes), `POST
//!   /api/prompts/sample/{name}`, `POST /api/prompts/piece/{id}`: make a prompt;
//! - `POST /api/jobs` (JSON settings): queue a job (202), or 503 when the
//!   queue is full; `GET /api/jobs/{id}`: its progress and pieces; `POST
//!   /api/jobs/{id}/cancel`;
//! - `GET /api/pieces`: every piece made since the start;
//! - `GET /files/{name}`: a generated file.
//!
//! Errors are JSON `{"error": "..."}` with a 4xx/5xx status.

use std::pin::Pin;
use std::sync::Arc;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use super::state::{clean_name, JobRequest, Shared, SubmitError};
use super::{MAX_SAMPLES, MAX_TOKENS};

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");

/// Largest JSON body (job settings).
const MAX_JSON: usize = 16 * 1024;

type AppState = State<Arc<Shared>>;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route(
            "/",
            get(|| async { page(INDEX_HTML, "text/html; charset=utf-8") }),
        )
        .route(
            "/app.js",
            get(|| async { page(APP_JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/app.css",
            get(|| async { page(APP_CSS, "text/css; charset=utf-8") }),
        )
        .route("/api/info", get(info))
        .route("/api/prompts", post(upload_prompt))
        .route("/api/prompts/sample/{name}", post(sample_prompt))
        .route("/api/prompts/piece/{id}", post(piece_prompt))
        .route("/api/jobs", post(submit))
        .route("/api/jobs/{id}", get(job))
        .route("/api/jobs/{id}/cancel", post(cancel))
        .route("/api/pieces", get(pieces))
        .route("/files/{name}", get(file))
        // Bodies are read with their own limits below.
        .layer(DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn(same_origin))
        .with_state(shared)
}

fn page(text: &'static str, kind: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        text,
    )
        .into_response()
}

/// Refuses a request that changes something (anything but GET and HEAD)
/// when a browser says it comes from a page of another site: another site
/// open in the same browser cannot start jobs or upload prompts here.
async fn same_origin(req: Request, next: axum::middleware::Next) -> Response {
    let safe = req.method() == Method::GET || req.method() == Method::HEAD;
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok());
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok());
    if let (false, Some(origin)) = (safe, origin) {
        let authority = origin.split_once("://").map_or(origin, |(_, a)| a);
        if host != Some(authority) {
            return ApiError(
                StatusCode::FORBIDDEN,
                format!("refused: a request from {origin} (another site)"),
            )
            .into_response();
        }
    }
    next.run(req).await
}

/// An error answer: `{"error": message}` with a status.
pub(crate) struct ApiError(StatusCode, String);

impl ApiError {
    fn bad(msg: impl Into<String>) -> Self {
        ApiError(StatusCode::BAD_REQUEST, msg.into())
    }
    fn not_found(what: impl Into<String>) -> Self {
        ApiError(StatusCode::NOT_FOUND, what.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let busy = self.0 == StatusCode::SERVICE_UNAVAILABLE;
        let mut r = (self.0, Json(json!({ "error": self.1, "busy": busy }))).into_response();
        if busy {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        }
        r
    }
}

/// Most bytes read (and dropped) of a body past its limit, so that the
/// client gets the 413 answer rather than a closed connection.
const DRAIN_LIMIT: usize = 64 << 20;

/// The body, refused (413) past `limit` bytes.
async fn read_body(req: Request, limit: usize, what: &str) -> Result<Bytes, ApiError> {
    let mut body = req.into_body();
    let mut kept = Vec::new();
    let mut seen = 0usize;
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        let frame = frame.map_err(|e| ApiError::bad(format!("cannot read the {what}: {e}")))?;
        if let Ok(data) = frame.into_data() {
            seen = seen.saturating_add(data.len());
            if seen <= limit {
                kept.extend_from_slice(&data);
            } else if seen > DRAIN_LIMIT {
                break;
            }
        }
    }
    if seen > limit {
        return Err(ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the {what} is larger than the limit of {} KiB",
                limit.div_ceil(1024)
            ),
        ));
    }
    Ok(kept.into())
}

async fn info(State(s): AppState) -> Json<serde_json::Value> {
    Json(json!({
        "model": s.model.name,
        "preset": s.model.preset,
        "parameters": s.model.parameters,
        "vocab_size": s.vocab().len(),
        "audio": s.soundfont.is_some(),
        "queue_capacity": s.queue,
        "max_upload_bytes": s.max_upload,
        "max_tokens": MAX_TOKENS,
        "max_samples": MAX_SAMPLES,
        "samples": s.sample_names(),
        "defaults": JobRequest::default(),
    }))
}

#[derive(Deserialize)]
struct NameQuery {
    name: Option<String>,
}

/// Parsing and tokenizing take a moment for a large file: off the async threads.
async fn make_prompt(
    s: Arc<Shared>,
    bytes: Bytes,
    name: String,
    source: &'static str,
) -> Result<Response, ApiError> {
    let info = tokio::task::spawn_blocking(move || s.add_prompt(&bytes, &name, source))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| ApiError(StatusCode::UNPROCESSABLE_ENTITY, format!("{e:#}")))?;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

async fn upload_prompt(
    State(s): AppState,
    Query(q): Query<NameQuery>,
    req: Request,
) -> Result<Response, ApiError> {
    let bytes = read_body(req, s.max_upload, "MIDI file").await?;
    if bytes.is_empty() {
        return Err(ApiError::bad("the upload is empty: choose a MIDI file"));
    }
    let name = clean_name(q.name.as_deref());
    make_prompt(s, bytes, name, "upload").await
}

async fn sample_prompt(State(s): AppState, Path(name): Path<String>) -> Result<Response, ApiError> {
    // Only a name from the list: nothing else of the disk is reachable.
    if !s.sample_names().contains(&name) {
        return Err(ApiError::not_found(format!(
            "no sample prompt named {name:?}"
        )));
    }
    let dir = s.samples.clone().expect("samples listed");
    let bytes = std::fs::read(dir.join(&name))
        .map_err(|e| ApiError::not_found(format!("cannot read sample {name}: {e}")))?;
    make_prompt(s, bytes.into(), name, "sample").await
}

async fn piece_prompt(State(s): AppState, Path(id): Path<u64>) -> Result<Response, ApiError> {
    let piece = s
        .piece(id)
        .ok_or_else(|| ApiError::not_found(format!("no piece {id}")))?;
    let name = format!("{}.mid", piece.name);
    let path = s
        .file_path(&name)
        .ok_or_else(|| ApiError::not_found(format!("no file {name}")))?;
    let bytes = std::fs::read(&path)
        .map_err(|e| ApiError::not_found(format!("cannot read {name}: {e}")))?;
    make_prompt(s, bytes.into(), name, "piece").await
}

async fn submit(State(s): AppState, req: Request) -> Result<Response, ApiError> {
    let bytes = read_body(req, MAX_JSON, "request").await?;
    let job: JobRequest = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad(format!("bad job settings: {e}")))?;
    match s.submit(job) {
        Ok(view) => Ok((StatusCode::ACCEPTED, Json(view)).into_response()),
        Err(SubmitError::Invalid(m)) => Err(ApiError::bad(m)),
        Err(SubmitError::Busy) => Err(ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "busy: a job is running and {} more are waiting; try again when one is done",
                s.queue
            ),
        )),
    }
}

async fn job(State(s): AppState, Path(id): Path<u64>) -> Result<Response, ApiError> {
    s.job(id)
        .map(|v| Json(v).into_response())
        .ok_or_else(|| ApiError::not_found(format!("no job {id}")))
}

async fn cancel(State(s): AppState, Path(id): Path<u64>) -> Result<Response, ApiError> {
    if !s.cancel(id) {
        return Err(ApiError::not_found(format!("no job {id}")));
    }
    Ok(Json(s.job(id)).into_response())
}

async fn pieces(State(s): AppState) -> Json<serde_json::Value> {
    let inner = s.lock();
    Json(json!({ "pieces": inner.gallery }))
}

async fn file(
    State(s): AppState,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let path = s
        .file_path(&name)
        .ok_or_else(|| ApiError::not_found(format!("no file {name}")))?;
    let bytes = tokio::task::spawn_blocking(move || std::fs::read(path))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| ApiError::not_found(format!("cannot read {name}: {e}")))?;
    let kind = match name.rsplit('.').next() {
        Some("wav") => "audio/wav",
        Some("png") => "image/png",
        Some("mid") => "audio/midi",
        Some("json") => "application/json",
        _ => "text/plain; charset=utf-8",
    };
    let total = bytes.len();
    // One byte range (`bytes=A-B`, `bytes=A-`, `bytes=-N`), so that the
    // audio player can seek; anything else gets the whole file.
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| byte_range(v, total));
    let ranges = [(header::ACCEPT_RANGES, "bytes".to_string())];
    Ok(match range {
        Some((a, b)) => (
            StatusCode::PARTIAL_CONTENT,
            ranges,
            [
                (header::CONTENT_TYPE, kind.to_string()),
                (header::CONTENT_RANGE, format!("bytes {a}-{b}/{total}")),
            ],
            Body::from(bytes[a..=b].to_vec()),
        )
            .into_response(),
        None => (
            ranges,
            [(header::CONTENT_TYPE, kind.to_string())],
            Body::from(bytes),
        )
            .into_response(),
    })
}

/// The inclusive byte range `spec` asks of a `total`-byte file, if it is
/// one satisfiable range.
fn byte_range(spec: &str, total: usize) -> Option<(usize, usize)> {
    let (a, b) = spec.strip_prefix("bytes=")?.trim().split_once('-')?;
    if total == 0 || b.contains(',') {
        return None;
    }
    let (a, b) = match (a.trim(), b.trim()) {
        ("", n) => {
            let n: usize = n.parse().ok()?;
            (total.saturating_sub(n), total - 1)
        }
        (a, "") => (a.parse().ok()?, total - 1),
        (a, b) => (a.parse().ok()?, b.parse::<usize>().ok()?.min(total - 1)),
    };
    (a <= b && b < total).then_some((a, b))
}

#[cfg(test)]
mod tests {
    use super::byte_range;

    #[test]
    fn byte_ranges() {
        assert_eq!(byte_range("bytes=0-", 10), Some((0, 9)));
        assert_eq!(byte_range("bytes=2-4", 10), Some((2, 4)));
        assert_eq!(byte_range("bytes=2-40", 10), Some((2, 9)));
        assert_eq!(byte_range("bytes=-3", 10), Some((7, 9)));
        assert_eq!(byte_range("bytes=10-", 10), None);
        assert_eq!(byte_range("bytes=5-2", 10), None);
        assert_eq!(byte_range("bytes=0-1,4-5", 10), None);
        assert_eq!(byte_range("items=0-1", 10), None);
        assert_eq!(byte_range("bytes=0-", 0), None);
    }
}
