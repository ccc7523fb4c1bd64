//! `cadenza serve`: a local web studio. One page (embedded in the binary,
//! nothing fetched from elsewhere) to pick or upload a prompt, generate with
//! live progress, listen, look at the piano roll, compare statistics and
//! download the files.
//!
//! One model is loaded once and owned by a single worker thread (tch modules
//! are not `Sync`); the HTTP handlers (axum on tokio) send it jobs over a
//! bounded channel and answer 503 "busy" when the queue is full. Generated
//! files go to one output folder under names that are never reused.
//!
//! The server outlives its clients: `serve` ignores SIGPIPE (a hung-up
//! client fails one write, not the process), files are streamed in chunks
//! ([`files`]), and only requests whose `Host` names the studio are
//! answered ([`host`]).

mod files;
mod host;
mod routes;
mod settings;
mod state;
mod worker;
mod zip;

use std::io::Write;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{bail, Context, Result};

pub use settings::{MAX_BARS, MAX_SEED};
pub use state::{JobRequest, JobState, JobView, PieceFilesView, PieceView, PromptInfo};

/// Most tokens one job may ask for per piece.
pub const MAX_TOKENS: usize = 8192;
/// Most pieces one job may ask for.
pub const MAX_SAMPLES: usize = 8;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Trained run folder or shipped model folder (e.g. models/cadenza-small).
    #[arg(long)]
    pub model: PathBuf,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Address to listen on; anything but a loopback address makes the
    /// studio reachable from other machines.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Folder for the generated pieces (created if missing; existing files
    /// are never overwritten).
    #[arg(long, default_value = "studio")]
    pub out: PathBuf,
    /// Folder of sample prompts offered on the page.
    #[arg(long, default_value = "midi_samples")]
    pub samples: PathBuf,
    /// Jobs that may wait behind the running one; more get "busy".
    #[arg(long, default_value_t = 4)]
    pub queue: usize,
    /// Largest prompt upload, in KiB.
    #[arg(long, default_value_t = 2048)]
    pub max_upload_kib: usize,
    /// SoundFont for the audio (default: a system General MIDI SoundFont).
    #[arg(long)]
    pub soundfont: Option<PathBuf>,
    /// Device to run the model on: auto (CUDA when available), cpu, cuda or cuda:N.
    #[arg(long)]
    pub device: Option<crate::cli::DeviceArg>,
    /// libtorch threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Precision of the dense products: auto (bf16 on CUDA and on CPUs with AMX or
    /// AVX512-BF16, f32 elsewhere), f32 or bf16.
    #[arg(long, value_enum, default_value_t = crate::model::Precision::Auto)]
    pub precision: crate::model::Precision,
}

/// What [`start`] needs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub model: PathBuf,
    pub host: String,
    /// 0 picks a free port ([`Server::addr`] tells which).
    pub port: u16,
    pub out: PathBuf,
    /// Sample prompts; a missing folder offers none.
    pub samples: Option<PathBuf>,
    pub queue: usize,
    pub max_upload: usize,
    pub soundfont: Option<PathBuf>,
    pub device: Option<String>,
    pub threads: usize,
    pub precision: crate::model::Precision,
}

impl ServeOptions {
    pub fn new(model: impl Into<PathBuf>, out: impl Into<PathBuf>) -> Self {
        ServeOptions {
            model: model.into(),
            host: "127.0.0.1".into(),
            port: 0,
            out: out.into(),
            samples: None,
            queue: 4,
            max_upload: 2 << 20,
            soundfont: None,
            device: None,
            threads: 0,
            precision: crate::model::Precision::Auto,
        }
    }
}

/// A running studio. Dropping it stops the HTTP server (the job running, if
/// any, finishes first).
pub struct Server {
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Server {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR/`.
    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// Serves until the process is stopped (or the server fails).
    pub fn wait(mut self) -> Result<()> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| anyhow::anyhow!("the HTTP server panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Loads the model, binds the address and serves in background threads;
/// returns once the studio answers.
pub fn start(opts: ServeOptions) -> Result<Server> {
    if opts.queue == 0 {
        bail!("--queue must be at least 1");
    }
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("cannot create output folder {}", opts.out.display()))?;
    let soundfont = match crate::render::find_soundfont(opts.soundfont.as_deref()) {
        Ok(p) => Some(p),
        Err(e) if opts.soundfont.is_none() => {
            tracing::warn!("pieces will have no audio: {e:#}");
            None
        }
        Err(e) => return Err(e),
    };
    let addr = (opts.host.as_str(), opts.port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve --host {}", opts.host))?
        .next()
        .with_context(|| format!("--host {} names no address", opts.host))?;
    let listener = TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;

    let (tx, rx) = std::sync::mpsc::sync_channel(opts.queue);
    let (model, shared_tx) = worker::spawn(&opts, rx)?;
    let check = host::HostCheck::new(addr, &opts.host);
    let shared = Arc::new(state::Shared::new(&opts, model, soundfont, tx, check));
    let (listed, unreadable) = shared.load_gallery();
    if listed > 0 {
        tracing::info!(
            "the gallery lists {listed} pieces already in {}",
            opts.out.display()
        );
    }
    if unreadable > 0 {
        tracing::warn!(
            "{unreadable} piece records in {} could not be read and are not listed",
            opts.out.display()
        );
    }
    shared_tx
        .send(Arc::downgrade(&shared))
        .context("the generator thread stopped")?;
    let app = routes::router(shared);

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("cadenza-http".into())
        .spawn(move || -> Result<()> {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_io()
                .build()
                .context("cannot start the async runtime")?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stop_rx.await;
                    })
                    .await
                    .context("the HTTP server stopped")
            })
        })?;
    Ok(Server {
        addr,
        shutdown: Some(stop_tx),
        thread: Some(thread),
    })
}

pub fn serve(a: ServeArgs) -> Result<i32> {
    // `cadenza-torch` restores SIGPIPE's default action for the commands that
    // print (`generate ... | head`); a server must outlive a client that
    // hangs up in the middle of a download.
    crate::util::ignore_broken_pipe();
    let samples = a.samples.is_dir().then(|| a.samples.clone());
    let opts = ServeOptions {
        model: a.model,
        host: a.host,
        port: a.port,
        out: a.out,
        samples,
        queue: a.queue,
        max_upload: a.max_upload_kib.saturating_mul(1024),
        soundfont: a.soundfont,
        device: a.device.map(|d| d.to_string()),
        threads: a.threads,
        precision: a.precision,
    };
    let out = opts.out.clone();
    let server = start(opts)?;
    if !server.addr().ip().is_loopback() {
        tracing::warn!(
            "listening on {}: other machines can reach the studio",
            server.addr()
        );
    }
    // Not `println!`: with SIGPIPE ignored, a closed stdout would panic it.
    let _ = writeln!(
        std::io::stdout(),
        "cadenza studio: {} (pieces go to {}; Ctrl-C stops)",
        server.url(),
        out.display()
    )
    .and_then(|()| std::io::stdout().flush());
    server.wait()?;
    Ok(0)
}
