//! The HTTP side: the page's three files and a small JSON API.
//!
//! - `GET /`, `/app.js`, `/app.css`: the page (embedded in the binary);
//! - `GET /api/info`: the model, the limits, the sample prompts, the defaults;
//! - `POST /api/prompts?name=FILE.mid` (body: the MIDI bytes), `POST
//!   /api/prompts/sample/{name}`, `POST /api/prompts/piece/{id}`: make a prompt;
//!   `GET /api/prompts/{id}`: one made before;
//! - `POST /api/jobs` (JSON settings): queue a job (202), or 503 when the
//!   queue is full; `GET /api/jobs`: those queued or running; `GET
//!   /api/jobs/{id}`: its progress and pieces; `POST /api/jobs/{id}/cancel`;
//! - `GET /api/pieces`: every piece in the output folder;
//! - `GET /api/pieces/{id}/notes`: its notes and bar lines in seconds, for
//!   the page's piano roll;
//! - `GET /api/pieces/{id}/zip`, `GET /api/jobs/{id}/zip`: all files of a
//!   piece, or of every piece of a job, as one zip archive;
//! - `GET /files/{name}`: a generated file, streamed, with byte ranges
//!   ([`super::files`]).
//!
//! Every request must name the studio in its `Host` header ([`super::host`]).
//!
//! Errors are JSON `{"error": "..."}` with a 4xx/5xx status.

use std::pin::Pin;
use std::sync::Arc;

use axum::body::{Bytes, HttpBody};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use super::state::{clean_name, JobRequest, PieceView, Shared, SubmitError};
use super::{files, settings};
use super::{MAX_BARS, MAX_SAMPLES, MAX_SEED, MAX_TOKENS};

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
        .route("/api/prompts/{id}", get(prompt))
        .route("/api/jobs", post(submit).get(jobs))
        .route("/api/jobs/{id}", get(job))
        .route("/api/jobs/{id}/cancel", post(cancel))
        .route("/api/pieces", get(pieces))
        .route("/api/pieces/{id}/zip", get(piece_zip))
        .route("/api/pieces/{id}/notes", get(piece_notes))
        .route("/api/jobs/{id}/zip", get(job_zip))
        .route("/files/{name}", get(file))
        // Bodies are read with their own limits below.
        .layer(DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn(same_origin))
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            known_host,
        ))
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

/// Refuses (403) a request whose `Host` is not the studio's own
/// ([`super::host`]): a page of another site that rebound its name to this
/// address can neither read the pieces nor start jobs.
async fn known_host(State(s): AppState, req: Request, next: axum::middleware::Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok());
    match host {
        Some(h) if s.host.allows(h) => next.run(req).await,
        Some(h) => ApiError(
            StatusCode::FORBIDDEN,
            format!(
                "refused: this studio answers to {} or localhost, not to the name \"{}\"",
                s.host.served,
                cadenza_core::util::excerpt(h, 80)
            ),
        )
        .into_response(),
        None => ApiError(
            StatusCode::BAD_REQUEST,
            "refused: the request has no Host header".into(),
        )
        .into_response(),
    }
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
        "max_bars": MAX_BARS,
        "max_seed": MAX_SEED,
        "samples": s.sample_names(),
        "instruments": (0..128u8)
            .map(|p| json!({ "program": p, "name": cadenza_core::render::gm_program_name(p) }))
            .collect::<Vec<_>>(),
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
    let job = settings::parse(&bytes).map_err(ApiError::bad)?;
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

/// The jobs that are queued or running, oldest first: a page opened (or
/// reloaded) while one runs finds it here.
async fn jobs(State(s): AppState) -> Json<serde_json::Value> {
    Json(json!({ "jobs": s.active_jobs() }))
}

async fn prompt(State(s): AppState, Path(id): Path<u64>) -> Result<Response, ApiError> {
    let inner = s.lock();
    inner
        .prompts
        .get(&id)
        .map(|p| Json(&p.info).into_response())
        .ok_or_else(|| ApiError::not_found(format!("no prompt {id} (forgotten, or never made)")))
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

/// The files of these pieces, as `(name, path)`.
fn piece_files(s: &Shared, pieces: &[PieceView]) -> Vec<(String, std::path::PathBuf)> {
    pieces
        .iter()
        .flat_map(|p| p.files.urls())
        .filter_map(|url| {
            let name = url.strip_prefix("/files/")?.to_string();
            let path = s.file_path(&name)?;
            Some((name, path))
        })
        .collect()
}

async fn zip_answer(
    s: &Shared,
    pieces: &[PieceView],
    download: String,
) -> Result<Response, ApiError> {
    let files = piece_files(s, pieces);
    if files.is_empty() {
        return Err(ApiError::not_found("no files to put in an archive"));
    }
    files::send_zip(files, &download).await.map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot make the archive: {e}"),
        )
    })
}

/// The notes of a piece's MIDI file as the roll draws them: `[start
/// seconds, duration seconds, pitch, drum (0/1), velocity]`, with the bar
/// starts and the length in seconds.
async fn piece_notes(State(s): AppState, Path(id): Path<u64>) -> Result<Response, ApiError> {
    let piece = s
        .piece(id)
        .ok_or_else(|| ApiError::not_found(format!("no piece {id}")))?;
    let name = format!("{}.mid", piece.name);
    let path = s
        .file_path(&name)
        .ok_or_else(|| ApiError::not_found(format!("no file {name}")))?;
    let roll = tokio::task::spawn_blocking(move || -> Result<serde_json::Value, String> {
        let bytes = std::fs::read(&path).map_err(|e| format!("cannot read {name}: {e}"))?;
        let (score, _) = crate::midi::parse(&bytes).map_err(|e| format!("{name}: {e}"))?;
        Ok(roll_json(&score))
    })
    .await
    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e))?;
    Ok(Json(roll).into_response())
}

/// Milliseconds are plenty for drawing.
fn ms(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn roll_json(score: &crate::midi::Score) -> serde_json::Value {
    let end = score.end_tick();
    let notes: Vec<serde_json::Value> = score
        .notes
        .iter()
        .map(|n| {
            let a = score.tick_to_seconds(n.start);
            let b = score.tick_to_seconds(n.end());
            json!([ms(a), ms(b - a), n.pitch, u8::from(n.is_drum), n.velocity])
        })
        .collect();
    let bars: Vec<f64> = score
        .bar_ticks(end)
        .into_iter()
        .map(|t| ms(score.tick_to_seconds(t)))
        .collect();
    json!({ "seconds": ms(score.tick_to_seconds(end)), "bars": bars, "notes": notes })
}

async fn piece_zip(State(s): AppState, Path(id): Path<u64>) -> Result<Response, ApiError> {
    let piece = s
        .piece(id)
        .ok_or_else(|| ApiError::not_found(format!("no piece {id}")))?;
    let download = format!("{}.zip", piece.name);
    zip_answer(&s, &[piece], download).await
}

async fn job_zip(State(s): AppState, Path(id): Path<u64>) -> Result<Response, ApiError> {
    let job = s
        .job(id)
        .ok_or_else(|| ApiError::not_found(format!("no job {id}")))?;
    let first = job
        .pieces
        .first()
        .ok_or_else(|| ApiError::not_found(format!("job {id} has no pieces (yet)")))?;
    // `stem-seedS-1` -> `stem-seedS-all`
    let stem = first
        .name
        .rsplit_once('-')
        .map_or(first.name.as_str(), |(a, _)| a);
    let download = format!("{stem}-all.zip");
    zip_answer(&s, &job.pieces, download).await
}

async fn file(
    State(s): AppState,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let path = s
        .file_path(&name)
        .ok_or_else(|| ApiError::not_found(format!("no file {name}")))?;
    let range = headers.get(header::RANGE).and_then(|v| v.to_str().ok());
    files::send(path, &name, range)
        .await
        .map_err(|e| ApiError::not_found(format!("cannot read {name}: {e}")))
}
