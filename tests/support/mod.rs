//! What the studio tests share: a tiny model trained in seconds on the
//! bundled samples, a studio started in this process, and an HTTP client.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cadenza::serve::{self, JobView, ServeOptions, Server};
use cadenza::tokenizer::{dataset, Vocab};
use cadenza::train::{self, TrainOptions};

/// A tiny model, trained once per test binary (a few seconds): the sample
/// prompts plus a few scales, 12 steps. Its folder lives as long as the process.
pub fn tiny_model() -> &'static Path {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("cadenza-serve-model")
            .tempdir()
            .unwrap()
            .keep();
        let midi_dir = dir.join("midi");
        std::fs::create_dir_all(&midi_dir).unwrap();
        for f in std::fs::read_dir("midi_samples").unwrap() {
            let p = f.unwrap().path();
            if dataset::is_midi_path(&p) {
                std::fs::copy(&p, midi_dir.join(p.file_name().unwrap())).unwrap();
            }
        }
        for k in 0..6u8 {
            let mut s = cadenza::midi::Score::new(480);
            for i in 0..32u64 {
                let degree = [0u8, 2, 4, 5, 7, 9, 11, 12][(i % 8) as usize];
                s.notes.push(cadenza::midi::Note {
                    start: i * 240,
                    duration: 240,
                    pitch: 55 + k + degree,
                    velocity: 80,
                    program: 0,
                    channel: 0,
                    is_drum: false,
                });
            }
            cadenza::midi::write_file(&s, &midi_dir.join(format!("scale{k}.mid"))).unwrap();
        }
        let data = dir.join("data");
        let vocab = Vocab::new(Default::default()).unwrap();
        let files = dataset::collect_midi_files(&[midi_dir]).unwrap();
        let results = dataset::tokenize_files(&files, &vocab, &|| {});
        dataset::write_dataset(&data, &vocab, &files, results).unwrap();
        let run = dir.join("run");
        train::train(&TrainOptions {
            run_dir: run.clone(),
            data: Some(data),
            preset: Some("tiny".into()),
            steps: Some(12),
            seq_len: Some(64),
            batch: Some(4),
            seed: Some(1),
            threads: Some(1),
            ..Default::default()
        })
        .unwrap();
        run
    })
}

/// Options for a studio on a free port of 127.0.0.1 with the tiny model,
/// the bundled samples and its own output folder.
pub fn options(out: &Path) -> ServeOptions {
    let mut o = ServeOptions::new(tiny_model(), out);
    o.samples = Some(PathBuf::from("midi_samples"));
    o.threads = 1;
    o.device = Some("cpu".into());
    o
}

pub fn start(opts: ServeOptions) -> Server {
    serve::start(opts).expect("the studio starts")
}

/// A studio with its own output folder, [`options`] changed by `change`;
/// its URL and a client.
pub fn studio(
    change: impl FnOnce(&mut ServeOptions),
) -> (tempfile::TempDir, Server, String, ureq::Agent) {
    let out = tempfile::tempdir().unwrap();
    let mut opts = options(out.path());
    change(&mut opts);
    let server = start(opts);
    let base = server.url();
    (out, server, base, agent())
}

/// An HTTP client that returns 4xx/5xx answers instead of failing on them.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into()
}

/// Status and JSON body of an answer.
pub fn json(r: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> (u16, serde_json::Value) {
    let r = r.expect("the studio answers");
    let status = r.status().as_u16();
    let body = r
        .into_body()
        .read_json::<serde_json::Value>()
        .expect("a JSON answer");
    (status, body)
}

/// Waits (at most `limit`) until a job has finished; its last view.
pub fn wait_job(agent: &ureq::Agent, base: &str, id: u64, limit: Duration) -> JobView {
    let t0 = Instant::now();
    loop {
        let (status, v) = json(agent.get(format!("{base}api/jobs/{id}")).call());
        assert_eq!(status, 200, "{v}");
        let job: JobView = serde_json::from_value(v).unwrap();
        if job.state.finished() {
            return job;
        }
        assert!(t0.elapsed() < limit, "job {id} still {:?}", job.state);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Length in seconds of a WAV file's bytes.
pub fn wav_seconds(bytes: &[u8]) -> f64 {
    let r = hound::WavReader::new(std::io::Cursor::new(bytes)).expect("a WAV file");
    r.duration() as f64 / r.spec().sample_rate as f64
}
