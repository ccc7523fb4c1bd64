//! The studio over HTTP: every endpoint, bad uploads and settings, a full
//! queue, cancellation, files never overwritten, and a burst of 20
//! concurrent requests.

mod support;

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use cadenza::serve::{JobState, JobView, PieceView, PromptInfo};
use serde_json::{json, Value};
use support::{agent, json as answer, options, start, studio, wait_job, wav_seconds};

const SAMPLE: &str = "oneills-reel-4-4.mid";

fn sample_bytes() -> Vec<u8> {
    std::fs::read(Path::new("midi_samples").join(SAMPLE)).unwrap()
}

fn upload(a: &ureq::Agent, base: &str, name: &str, bytes: &[u8]) -> (u16, Value) {
    answer(
        a.post(format!("{base}api/prompts?name={name}"))
            .header("content-type", "audio/midi")
            .send(bytes),
    )
}

fn submit(a: &ureq::Agent, base: &str, settings: Value) -> (u16, Value) {
    answer(a.post(format!("{base}api/jobs")).send_json(settings))
}

fn get_bytes(a: &ureq::Agent, url: String) -> (u16, String, Vec<u8>) {
    let r = a.get(url).call().unwrap();
    let status = r.status().as_u16();
    let kind = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = r
        .into_body()
        .with_config()
        .limit(1 << 30)
        .read_to_vec()
        .unwrap();
    (status, kind, body)
}

#[test]
fn page_and_info_are_served_without_outside_resources() {
    let out = tempfile::tempdir().unwrap();
    let server = start(options(out.path()));
    let base = server.url();
    assert!(server.addr().ip().is_loopback());
    let a = agent();
    for (path, kind, needle) in [
        ("", "text/html", "cadenza studio"),
        ("app.js", "text/javascript", "/api/jobs"),
        ("app.css", "text/css", ".piece"),
    ] {
        let (status, got, body) = get_bytes(&a, format!("{base}{path}"));
        assert_eq!(status, 200, "{path}");
        assert!(got.starts_with(kind), "{path}: {got}");
        let text = String::from_utf8(body).unwrap();
        assert!(text.contains(needle), "{path}");
        // Works offline: nothing is loaded from another host.
        assert!(
            !text.contains("http://") && !text.contains("https://"),
            "{path}"
        );
    }
    let (status, info) = answer(a.get(format!("{base}api/info")).call());
    assert_eq!(status, 200);
    assert_eq!(info["samples"].as_array().unwrap().len(), 3, "{info}");
    assert_eq!(info["queue_capacity"], 4);
    assert_eq!(info["defaults"]["tokens"], 512);
    assert!(info["vocab_size"].as_u64().unwrap() > 100);
    assert!(info["parameters"].as_u64().unwrap() > 0);
    let (status, g) = answer(a.get(format!("{base}api/pieces")).call());
    assert_eq!((status, g), (200, json!({ "pieces": [] })));
    let (status, _, _) = get_bytes(&a, format!("{base}nothing-here"));
    assert_eq!(status, 404);
}

#[test]
fn prompts_are_checked_like_on_the_command_line() {
    let (_out, _server, base, a) = studio(|o| o.max_upload = 64 * 1024);

    // A good upload.
    let (status, v) = upload(&a, &base, SAMPLE, &sample_bytes());
    assert_eq!(status, 201, "{v}");
    let p: PromptInfo = serde_json::from_value(v).unwrap();
    assert_eq!((p.name.as_str(), p.source.as_str()), (SAMPLE, "upload"));
    assert!(p.bars >= 8 && p.notes > 0 && p.tokens > 0, "{p:?}");

    // Not MIDI, truncated, no notes: the command line's messages.
    let bytes = sample_bytes();
    let no_notes = cadenza::midi::to_bytes(&cadenza::midi::Score::new(480)).unwrap();
    for (name, bad) in [
        ("junk.mid", b"this is not a MIDI file at all".to_vec()),
        ("cut.mid", bytes[..30].to_vec()),
        ("empty-score.mid", no_notes),
    ] {
        let (status, v) = upload(&a, &base, name, &bad);
        assert_eq!(status, 422, "{name}: {v}");
        let cli = match cadenza::midi::parse_named(&bad, Path::new(name)) {
            Err(e) => e.to_string(),
            Ok(_) => format!("{name}: the prompt has no notes"),
        };
        assert_eq!(v["error"].as_str().unwrap(), cli, "{name}");
    }
    // A path in the name is cut to the file name.
    let (status, v) = upload(&a, &base, "..%2F..%2Fetc%2Fx.mid", b"MThd");
    assert_eq!(status, 422);
    assert!(v["error"].as_str().unwrap().starts_with("x.mid: "), "{v}");

    // Empty and too large.
    let (status, v) = upload(&a, &base, "e.mid", b"");
    assert_eq!(status, 400, "{v}");
    let big = vec![0u8; 1 << 20];
    let (status, v) = upload(&a, &base, "big.mid", &big);
    assert_eq!(status, 413, "{v}");
    assert!(v["error"].as_str().unwrap().contains("64 KiB"), "{v}");

    // Samples: by name from the list only.
    let (status, v) = answer(
        a.post(format!("{base}api/prompts/sample/oneills-jig-6-8.mid"))
            .send_empty(),
    );
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["source"], "sample");
    for name in ["nope.mid", "..%2FCargo.toml"] {
        let (status, _) = answer(
            a.post(format!("{base}api/prompts/sample/{name}"))
                .send_empty(),
        );
        assert_eq!(status, 404, "{name}");
    }
    // A piece that does not exist cannot be continued.
    let (status, _) = answer(a.post(format!("{base}api/prompts/piece/999")).send_empty());
    assert_eq!(status, 404);
}

#[test]
fn bad_job_settings_are_refused_with_a_reason() {
    let (_out, server, base, a) = studio(|_| {});
    for (settings, needle) in [
        (json!({ "tokens": 0 }), "tokens"),
        (json!({ "tokens": 100000 }), "tokens"),
        (json!({ "top_p": 1.5 }), "top-p"),
        (json!({ "temperature": 0 }), "temperature"),
        (json!({ "num_samples": 99 }), "samples"),
        (json!({ "prompt_bars": 0 }), "bars"),
        (json!({ "prompt": 12345 }), "prompt 12345"),
        (json!({ "colour": "blue" }), "unknown field"),
        (json!({ "programs": "piano" }), "--programs"),
        (json!({ "tokens": "many" }), "bad job settings"),
    ] {
        let (status, v) = submit(&a, &base, settings.clone());
        assert_eq!(status, 400, "{settings}: {v}");
        assert!(
            v["error"].as_str().unwrap().contains(needle),
            "{settings}: {v}"
        );
    }
    let (status, v) = answer(
        a.post(format!("{base}api/jobs"))
            .header("content-type", "application/json")
            .send("{not json"),
    );
    assert_eq!(status, 400, "{v}");
    // Another site's page cannot start jobs here; this one's can.
    let (status, v) = answer(
        a.post(format!("{base}api/jobs"))
            .header("origin", "http://example.com")
            .send_json(json!({ "tokens": 8 })),
    );
    assert_eq!(status, 403, "{v}");
    let own = format!("http://{}", server.addr());
    let (status, v) = answer(
        a.post(format!("{base}api/jobs"))
            .header("origin", own)
            .send_json(json!({ "tokens": 8 })),
    );
    assert_eq!(status, 202, "{v}");
    let (status, _) = answer(a.get(format!("{base}api/jobs/777")).call());
    assert_eq!(status, 404);
    let (status, _) = answer(a.post(format!("{base}api/jobs/777/cancel")).send_empty());
    assert_eq!(status, 404);
}

#[test]
fn a_job_makes_pieces_with_every_file_and_names_are_never_reused() {
    let (out, server, base, a) = studio(|_| {});
    let (_, v) = answer(
        a.post(format!("{base}api/prompts/sample/{SAMPLE}"))
            .send_empty(),
    );
    let prompt: PromptInfo = serde_json::from_value(v).unwrap();
    let (status, v) = submit(
        &a,
        &base,
        json!({ "prompt": prompt.id, "prompt_bars": 2, "tokens": 40, "seed": 3, "num_samples": 2 }),
    );
    assert_eq!(status, 202, "{v}");
    let job: JobView = serde_json::from_value(v).unwrap();
    let job = wait_job(&a, &base, job.id, Duration::from_secs(120));
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    assert_eq!(job.tokens_done, 40);
    assert!(job.tokens_per_second > 0.0);
    assert_eq!(job.pieces.len(), 2);
    assert_ne!(job.pieces[0].name, job.pieces[1].name);

    let piece = &job.pieces[0];
    assert_eq!(piece.prompt_name.as_deref(), Some(SAMPLE));
    assert!(piece.tokens > piece.prompt_tokens);
    let ps = piece.prompt_stats.as_ref().expect("prompt statistics");
    assert_eq!(ps.bars, 2);
    assert!(piece.stats.notes >= ps.notes);
    // MIDI
    let (status, kind, midi) = get_bytes(&a, format!("{base}{}", &piece.files.midi[1..]));
    assert_eq!((status, kind.as_str()), (200, "audio/midi"));
    let (score, _) = cadenza::midi::parse(&midi).unwrap();
    assert_eq!(score.notes.len(), piece.notes);
    // WAV of the length reported
    let wav = piece.files.wav.as_ref().expect("a SoundFont is installed");
    let (status, kind, bytes) = get_bytes(&a, format!("{base}{}", &wav[1..]));
    assert_eq!((status, kind.as_str()), (200, "audio/wav"));
    let secs = wav_seconds(&bytes);
    assert!((secs - piece.audio_seconds.unwrap()).abs() < 1e-6);
    assert!(secs > piece.seconds, "{secs} vs {}", piece.seconds);
    // Byte ranges, for seeking in the audio player.
    let r = a
        .get(format!("{base}{}", &wav[1..]))
        .header("range", "bytes=0-43")
        .call()
        .unwrap();
    assert_eq!(r.status().as_u16(), 206);
    let range = r.headers()["content-range"].to_str().unwrap().to_string();
    assert_eq!(range, format!("bytes 0-43/{}", bytes.len()));
    assert_eq!(r.into_body().read_to_vec().unwrap(), bytes[..44]);
    // Piano roll
    let (status, kind, png) = get_bytes(&a, format!("{base}{}", &piece.files.png[1..]));
    assert_eq!((status, kind.as_str()), (200, "image/png"));
    assert_eq!(&png[1..4], b"PNG");
    // Tokens, one a line, BOS first
    let (status, _, text) = get_bytes(&a, format!("{base}{}", &piece.files.tokens[1..]));
    assert_eq!(status, 200);
    let text = String::from_utf8(text).unwrap();
    assert_eq!(text.lines().count(), piece.tokens);
    // Settings
    let (status, kind, s) = get_bytes(&a, format!("{base}{}", &piece.files.settings[1..]));
    assert_eq!((status, kind.as_str()), (200, "application/json"));
    let s: Value = serde_json::from_slice(&s).unwrap();
    assert_eq!(s["settings"]["seed"], 3);
    assert_eq!(s["prompt"], SAMPLE);
    // Only the studio's own files are served.
    for name in ["..%2FCargo.toml", "piece-9999.mid", "x"] {
        let (status, _, _) = get_bytes(&a, format!("{base}files/{name}"));
        assert_eq!(status, 404, "{name}");
    }

    // The gallery has both; a piece continues as a prompt.
    let (_, g) = answer(a.get(format!("{base}api/pieces")).call());
    let gallery: Vec<PieceView> = serde_json::from_value(g["pieces"].clone()).unwrap();
    assert_eq!(gallery, job.pieces);
    let (status, v) = answer(
        a.post(format!("{base}api/prompts/piece/{}", piece.id))
            .send_empty(),
    );
    assert_eq!(status, 201, "{v}");
    let next: PromptInfo = serde_json::from_value(v).unwrap();
    assert_eq!(next.source, "piece");
    assert_eq!(next.name, format!("{}.mid", piece.name));
    assert!(next.bars >= 2);
    let (status, v) = submit(
        &a,
        &base,
        json!({ "prompt": next.id, "prompt_bars": null, "tokens": 16 }),
    );
    assert_eq!(status, 202, "{v}");
    let cont = wait_job(
        &a,
        &base,
        v["id"].as_u64().unwrap(),
        Duration::from_secs(120),
    );
    assert_eq!(cont.state, JobState::Done, "{:?}", cont.error);
    assert_eq!(cont.pieces[0].prompt_tokens, next.tokens + 1);

    // A second studio on the same folder keeps the first one's files.
    let first: Vec<(std::path::PathBuf, Vec<u8>)> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    drop(server);
    let server = start(options(out.path()));
    let base = server.url();
    let (_, v) = submit(&a, &base, json!({ "tokens": 16 }));
    let again = wait_job(
        &a,
        &base,
        v["id"].as_u64().unwrap(),
        Duration::from_secs(120),
    );
    assert_eq!(again.state, JobState::Done, "{:?}", again.error);
    assert!(
        again.pieces[0].prompt_stats.is_none(),
        "started from nothing"
    );
    let taken: Vec<&str> = job
        .pieces
        .iter()
        .chain(&cont.pieces)
        .map(|p| p.name.as_str())
        .collect();
    assert!(!taken.contains(&again.pieces[0].name.as_str()), "{taken:?}");
    for (p, b) in first {
        assert_eq!(std::fs::read(&p).unwrap(), b, "{} changed", p.display());
    }
}

#[test]
fn a_full_queue_answers_busy_and_jobs_can_be_cancelled() {
    let (_out, _server, base, a) = studio(|o| o.queue = 1);
    let long = json!({ "tokens": 8192, "num_samples": 4 });
    let (status, v) = submit(&a, &base, long.clone());
    assert_eq!(status, 202, "{v}");
    let first = v["id"].as_u64().unwrap();
    // Wait until it runs (the queue is then empty again).
    loop {
        let (_, v) = answer(a.get(format!("{base}api/jobs/{first}")).call());
        let j: JobView = serde_json::from_value(v).unwrap();
        assert!(!j.state.finished(), "{j:?}");
        if j.state == JobState::Running && j.tokens_done > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, v) = submit(&a, &base, long.clone());
    assert_eq!(status, 202, "{v}");
    let second = v["id"].as_u64().unwrap();
    let (_, v) = answer(a.get(format!("{base}api/jobs/{second}")).call());
    assert_eq!(
        (v["state"].as_str(), v["queue_position"].as_u64()),
        (Some("queued"), Some(1))
    );

    let r = a.post(format!("{base}api/jobs")).send_json(&long).unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.into_body().read_json().unwrap();
    assert_eq!(v["busy"], true);
    assert!(v["error"].as_str().unwrap().starts_with("busy"), "{v}");

    // Cancel both: the waiting one never starts, the running one stops.
    for id in [second, first] {
        let (status, v) = answer(a.post(format!("{base}api/jobs/{id}/cancel")).send_empty());
        assert_eq!(status, 200, "{v}");
    }
    for id in [first, second] {
        let j = wait_job(&a, &base, id, Duration::from_secs(60));
        assert_eq!(j.state, JobState::Cancelled, "{j:?}");
        assert!(j.pieces.is_empty());
        assert!(j.tokens_done < 8192);
    }
    // The studio takes work again.
    let (status, v) = submit(&a, &base, json!({ "tokens": 8 }));
    assert_eq!(status, 202, "{v}");
    let j = wait_job(
        &a,
        &base,
        v["id"].as_u64().unwrap(),
        Duration::from_secs(60),
    );
    assert_eq!(j.state, JobState::Done);
}

/// Resident memory of this process, in MiB.
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

#[test]
fn twenty_concurrent_requests_are_all_answered() {
    let (_out, _server, base, a) = studio(|_| {});
    let (_, v) = answer(
        a.post(format!("{base}api/prompts/sample/{SAMPLE}"))
            .send_empty(),
    );
    let prompt = v["id"].as_u64().unwrap();
    let settings = json!({ "prompt": prompt, "tokens": 300 });
    // A first job warms everything up before memory is measured.
    let (_, v) = submit(&a, &base, json!({ "prompt": prompt, "tokens": 16 }));
    wait_job(
        &a,
        &base,
        v["id"].as_u64().unwrap(),
        Duration::from_secs(60),
    );
    let before = rss_mib();

    let barrier = Arc::new(Barrier::new(20));
    let threads: Vec<_> = (0..20)
        .map(|_| {
            let (barrier, base, settings) = (barrier.clone(), base.clone(), settings.clone());
            std::thread::spawn(move || {
                let a = agent();
                barrier.wait();
                submit(&a, &base, settings)
            })
        })
        .collect();
    let answers: Vec<(u16, Value)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let accepted: Vec<u64> = answers
        .iter()
        .filter(|(s, _)| *s == 202)
        .map(|(_, v)| v["id"].as_u64().unwrap())
        .collect();
    let busy = answers
        .iter()
        .filter(|(s, v)| *s == 503 && v["busy"] == true)
        .count();
    assert_eq!(accepted.len() + busy, 20, "{answers:?}");
    assert!(
        !accepted.is_empty() && busy > 0,
        "{} accepted",
        accepted.len()
    );
    // At most the running job and a full queue were taken at once.
    assert!(accepted.len() <= 5 + 1, "{} accepted", accepted.len());
    for id in &accepted {
        let j = wait_job(&a, &base, *id, Duration::from_secs(300));
        assert_eq!(j.state, JobState::Done, "{:?}", j.error);
    }
    let (status, g) = answer(a.get(format!("{base}api/pieces")).call());
    assert_eq!(status, 200);
    assert_eq!(g["pieces"].as_array().unwrap().len(), accepted.len() + 1);
    let grown = rss_mib() - before;
    eprintln!("resident memory: {before:.0} MiB before the burst, {grown:+.0} MiB after");
    assert!(grown < 400.0, "memory grew by {grown:.0} MiB");
}

#[test]
fn the_serve_command_listens_on_loopback_and_names_its_url() {
    use std::io::BufRead;
    let out = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_cadenza");
    // A model folder that is not there: a clear error, no server.
    let o = std::process::Command::new(bin)
        .args(["serve", "--model", "no/such/model", "--port", "0", "--out"])
        .arg(out.path())
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("model folder no/such/model does not exist"),
        "{err}"
    );

    let mut child = std::process::Command::new(bin)
        .args([
            "serve",
            "--port",
            "0",
            "--threads",
            "1",
            "--device",
            "cpu",
            "--model",
        ])
        .arg(support::tiny_model())
        .arg("--out")
        .arg(out.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .map(str::to_string);
    let answer = url
        .as_ref()
        .map(|u| answer(agent().get(format!("{u}api/info")).call()));
    child.kill().unwrap();
    child.wait().unwrap();
    let url = url.unwrap_or_else(|| panic!("no URL in {line:?}"));
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let (status, info) = answer.unwrap();
    assert_eq!(status, 200);
    assert_eq!(info["samples"].as_array().unwrap().len(), 3, "{info}");
}
