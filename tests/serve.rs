//! The studio over HTTP: every endpoint, bad uploads and settings (refused
//! in the page's words), a full queue, cancellation, files never
//! overwritten, a burst of 20 concurrent requests, the Host check, a new
//! seed per click, lengths in bars, the gallery read back at start, zip
//! archives, and a `cadenza serve` process that outlives 40 hung-up
//! downloads of a large WAV with its memory measured.

mod support;

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use cadenza::serve::{JobState, JobView, PieceView, PromptInfo};
use serde_json::{json, Value};
use support::{agent, json as answer, options, start, studio, wait_job, wav_seconds};

const SAMPLE: &str = "oneills-reel-4-4.mid";

/// The test that measures this process's memory takes it alone (write);
/// the others share it (read), so their studios do not count in its figure.
static MEASURED: std::sync::RwLock<()> = std::sync::RwLock::new(());

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

/// Takes the sample prompt `SAMPLE`: its PromptInfo as JSON.
fn sample_prompt(a: &ureq::Agent, base: &str) -> Value {
    answer(
        a.post(format!("{base}api/prompts/sample/{SAMPLE}"))
            .send_empty(),
    )
    .1
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
    let _measured = MEASURED.read().unwrap_or_else(|e| e.into_inner());
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
    assert_eq!(info["defaults"]["tokens"], 4096);
    assert_eq!(info["defaults"]["bars"], 16);
    assert_eq!(
        info["defaults"]["seed"],
        Value::Null,
        "a new seed per click"
    );
    assert_eq!(info["instruments"][33]["name"], "Fingered Bass");
    assert!(info["vocab_size"].as_u64().unwrap() > 100);
    assert!(info["parameters"].as_u64().unwrap() > 0);
    let (status, g) = answer(a.get(format!("{base}api/pieces")).call());
    assert_eq!((status, g), (200, json!({ "pieces": [] })));
    let (status, _, _) = get_bytes(&a, format!("{base}nothing-here"));
    assert_eq!(status, 404);
}

#[test]
fn prompts_are_checked_like_on_the_command_line() {
    let _measured = MEASURED.read().unwrap_or_else(|e| e.into_inner());
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
    let _measured = MEASURED.read().unwrap_or_else(|e| e.into_inner());
    let (_out, server, base, a) = studio(|_| {});
    for (settings, needle) in [
        (
            json!({ "tokens": 0 }),
            "Token limit must be between 1 and 8192",
        ),
        (json!({ "tokens": 100000 }), "Token limit"),
        (
            json!({ "top_p": 1.5 }),
            "Top-p must be above 0 and at most 1",
        ),
        (json!({ "temperature": 0 }), "Temperature must be above 0"),
        (
            json!({ "num_samples": 99 }),
            "Variations must be between 1 and 8",
        ),
        (
            json!({ "prompt_bars": 0 }),
            "Prompt bars must be at least 1",
        ),
        (json!({ "bars": 0 }), "Length must be between 1 and"),
        (json!({ "prompt": 12345 }), "prompt 12345"),
        (json!({ "colour": "blue" }), "unknown setting \"colour\""),
        (
            json!({ "programs": "piano" }),
            "Instruments: \"piano\" is neither",
        ),
        (
            json!({ "tokens": "many" }),
            "Token limit must be a whole number",
        ),
        (
            json!({ "seed": -3 }),
            "The seed must be a whole number from 0",
        ),
    ] {
        let (status, v) = submit(&a, &base, settings.clone());
        assert_eq!(status, 400, "{settings}: {v}");
        let e = v["error"].as_str().unwrap();
        assert!(e.contains(needle), "{settings}: {v}");
        // The page's words, not the command line's flags or serde's.
        assert!(!e.contains("--") && !e.contains("invalid type"), "{e}");
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
    let _measured = MEASURED.read().unwrap_or_else(|e| e.into_inner());
    let (out, server, base, a) = studio(|_| {});
    let v = sample_prompt(&a, &base);
    let prompt: PromptInfo = serde_json::from_value(v).unwrap();
    let (status, v) = submit(
        &a,
        &base,
        json!({ "prompt": prompt.id, "prompt_bars": 2, "tokens": 40, "bars": null, "seed": 3, "num_samples": 2 }),
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
    assert_eq!(s["piece"]["name"], json!(piece.name));
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
        json!({ "prompt": next.id, "prompt_bars": null, "tokens": 16, "bars": null }),
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
    // Its gallery lists them from the start, files downloadable.
    let (_, g) = answer(a.get(format!("{base}api/pieces")).call());
    let listed: Vec<PieceView> = serde_json::from_value(g["pieces"].clone()).unwrap();
    let names = |ps: &[PieceView]| ps.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
    let mut made: Vec<PieceView> = job.pieces.clone();
    made.extend(cont.pieces.clone());
    assert_eq!(names(&listed), names(&made));
    assert_eq!(listed[0].stats, made[0].stats);
    let (status, _, again_midi) = get_bytes(&a, format!("{base}{}", &listed[0].files.midi[1..]));
    assert_eq!((status, again_midi), (200, midi.clone()));
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
    assert_eq!(again.pieces[0].settings.seed, again.settings.seed);
    for (p, b) in first {
        assert_eq!(std::fs::read(&p).unwrap(), b, "{} changed", p.display());
    }
}

#[test]
fn a_full_queue_answers_busy_and_jobs_can_be_cancelled() {
    let _measured = MEASURED.read().unwrap_or_else(|e| e.into_inner());
    let (_out, _server, base, a) = studio(|o| o.queue = 1);
    let long = json!({ "tokens": 8192, "bars": null, "num_samples": 4 });
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
    let _measured = MEASURED.write().unwrap_or_else(|e| e.into_inner());
    let (_out, _server, base, a) = studio(|_| {});
    let v = sample_prompt(&a, &base);
    let prompt = v["id"].as_u64().unwrap();
    let settings = json!({ "prompt": prompt, "tokens": 300, "bars": null });
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
    let _measured = MEASURED.read().unwrap_or_else(|e| e.into_inner());
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

    let (mut child, line) = spawn_studio(out.path());
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

/// `cadenza serve` of the tiny model on a free port, writing to `out`: the
/// process and the first line it prints (the one with the URL).
fn spawn_studio(out: &Path) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_cadenza"))
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
        .arg(out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (child, line)
}

/// Sends `request` (a whole HTTP/1.1 request) over a new connection and
/// reads the answer to the end: `(status, headers and body as text)`.
fn raw(addr: std::net::SocketAddr, request: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut text = Vec::new();
    let _ = s.read_to_end(&mut text);
    let text = String::from_utf8_lossy(&text).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

#[test]
fn requests_that_do_not_name_the_studio_in_host_are_refused() {
    let _measured = MEASURED.read().unwrap_or_else(|e| e.into_inner());
    let (_out, server, base, a) = studio(|_| {});
    let addr = server.addr();
    let port = addr.port();
    let get = |host: &str, path: &str| {
        raw(
            addr,
            &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
        )
    };
    for host in [
        format!("evil.example:{port}"),
        "evil.example".to_string(),
        format!("127.0.0.1:{}", port.wrapping_add(1)),
        format!("localhost.evil.example:{port}"),
    ] {
        for path in ["/api/pieces", "/", "/api/info"] {
            let (status, text) = get(&host, path);
            assert_eq!(status, 403, "{host} {path}: {text}");
            assert!(text.contains("refused"), "{text}");
        }
    }
    let (status, text) = raw(addr, "GET /api/info HTTP/1.1\r\nConnection: close\r\n\r\n");
    assert_eq!(status, 400, "no Host: {text}");
    for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}")] {
        let (status, text) = get(&host, "/api/pieces");
        assert_eq!(status, 200, "{host}: {text}");
    }
    // A rebinding page's POST, whose Host and Origin agree on its name.
    let body = r#"{"tokens": 8}"#;
    let (status, text) = raw(
        addr,
        &format!(
            "POST /api/jobs HTTP/1.1\r\nHost: evil.example:{port}\r\nOrigin: http://evil.example:{port}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    );
    assert_eq!(status, 403, "{text}");
    let (_, v) = answer(a.get(format!("{base}api/jobs")).call());
    assert_eq!(v["jobs"], json!([]), "no job was queued: {v}");
}

#[test]
fn every_click_gets_a_new_seed_and_a_seed_given_again_gives_the_same_piece() {
    let _measured = MEASURED.read().unwrap_or_else(|e| e.into_inner());
    let (_out, _server, base, a) = studio(|_| {});
    let v = sample_prompt(&a, &base);
    let prompt = v["id"].as_u64().unwrap();
    let run = |settings: Value| -> JobView {
        let (status, v) = submit(&a, &base, settings);
        assert_eq!(status, 202, "{v}");
        let seed = v["settings"]["seed"].as_u64();
        assert!(seed.is_some(), "the seed used is shown when queued: {v}");
        let job = wait_job(
            &a,
            &base,
            v["id"].as_u64().unwrap(),
            Duration::from_secs(120),
        );
        assert_eq!(job.state, JobState::Done, "{:?}", job.error);
        assert_eq!(job.settings.seed, seed);
        job
    };
    let midi = |p: &PieceView| get_bytes(&a, format!("{base}{}", &p.files.midi[1..])).2;
    let settings = json!({ "prompt": prompt, "prompt_bars": 2, "tokens": 48, "bars": null });
    let one = run(settings.clone());
    let two = run(settings.clone());
    let (s1, s2) = (one.settings.seed.unwrap(), two.settings.seed.unwrap());
    assert_ne!(s1, s2, "two clicks, two seeds");
    assert!(s1 <= cadenza::serve::MAX_SEED && s2 <= cadenza::serve::MAX_SEED);
    assert_ne!(
        midi(&one.pieces[0]),
        midi(&two.pieces[0]),
        "two clicks, two pieces"
    );
    // Named after the prompt and the seed.
    assert_eq!(one.pieces[0].name, format!("oneills-reel-4-4-seed{s1}-1"));
    // "Again with this seed": the same piece, under a new name.
    let mut again = settings.clone();
    again["seed"] = json!(s1);
    let three = run(again);
    assert_eq!(three.settings.seed, Some(s1));
    assert_eq!(midi(&three.pieces[0]), midi(&one.pieces[0]));
    assert_eq!(
        three.pieces[0].name,
        format!("oneills-reel-4-4-seed{s1}-1-2")
    );
    // A seed too large for the page is refused in plain words.
    let (status, v) = answer(
        a.post(format!("{base}api/jobs"))
            .header("content-type", "application/json")
            .send(r#"{"seed": 99999999999999999999999}"#),
    );
    assert_eq!(status, 400);
    assert_eq!(
        v["error"],
        "The seed must be a whole number from 0 to 9007199254740991 (got 1e+23)"
    );
}

#[test]
fn a_length_in_bars_stops_the_piece_at_that_many_bars_after_the_prompt() {
    let _measured = MEASURED.read().unwrap_or_else(|e| e.into_inner());
    let (_out, _server, base, a) = studio(|_| {});
    let v = sample_prompt(&a, &base);
    let prompt = v["id"].as_u64().unwrap();
    let (status, v) = submit(
        &a,
        &base,
        json!({ "prompt": prompt, "prompt_bars": 2, "bars": 1, "tokens": 400, "seed": 5 }),
    );
    assert_eq!(status, 202, "{v}");
    let job = wait_job(
        &a,
        &base,
        v["id"].as_u64().unwrap(),
        Duration::from_secs(120),
    );
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    let p = &job.pieces[0];
    assert!(
        p.stats.bars <= 3,
        "2 prompt bars and 1 more, got {}",
        p.stats.bars
    );
    assert!(
        p.tokens - p.prompt_tokens < 400,
        "stopped by the bars, not the tokens: {p:?}"
    );
    assert_eq!(p.stop, cadenza::sample::Stop::MaxBars);
    let end = p.prompt_seconds.expect("where the prompt ends");
    assert!(end > 0.0 && end < p.seconds, "{end} of {}", p.seconds);
}

/// Resident memory of process `pid`, in MiB.
fn rss_of(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// SHA-256 of everything `r` reads, read in chunks.
fn sha256(mut r: impl std::io::Read) -> Vec<u8> {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = r.read(&mut buf).unwrap();
        if n == 0 {
            return h.finalize().to_vec();
        }
        h.update(&buf[..n]);
    }
}

/// A WAV file of `seconds` of a quiet sawtooth, 44.1 kHz stereo 16-bit.
fn big_wav(path: &Path, seconds: u32) {
    let spec = hound::WavSpec {
        channels: 2,
        sample_rate: 44_100,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    {
        let mut i16w = w.get_i16_writer(seconds * 44_100 * 2);
        for k in 0..seconds * 44_100 * 2 {
            i16w.write_sample((k % 97) as i16);
        }
        i16w.flush().unwrap();
    }
    w.finalize().unwrap();
}

#[test]
fn the_serve_command_outlives_clients_that_hang_up_and_streams_large_files() {
    let _measured = MEASURED.read().unwrap_or_else(|e| e.into_inner());
    use std::io::{Read, Write};
    // A piece made by a studio in this process; then its WAV is made large
    // (200 s, 34 MiB) and a `cadenza serve` process lists it at start.
    let out = tempfile::tempdir().unwrap();
    let name = {
        let server = start(options(out.path()));
        let a = agent();
        let (_, v) = submit(&a, &server.url(), json!({ "tokens": 16, "seed": 1 }));
        let job = wait_job(
            &a,
            &server.url(),
            v["id"].as_u64().unwrap(),
            Duration::from_secs(120),
        );
        assert_eq!(job.state, JobState::Done, "{:?}", job.error);
        job.pieces[0].name.clone()
    };
    let wav_path = out.path().join(format!("{name}.wav"));
    big_wav(&wav_path, 200);
    // Hashed, not held: this process's memory is measured by another test.
    let wav_hash = sha256(std::fs::File::open(&wav_path).unwrap());
    let size = std::fs::metadata(&wav_path).unwrap().len() as usize;
    let part_want = {
        use std::io::Seek;
        let mut f = std::fs::File::open(&wav_path).unwrap();
        f.seek(std::io::SeekFrom::Start(1_000_000)).unwrap();
        let mut b = vec![0u8; 1024];
        f.read_exact(&mut b).unwrap();
        b
    };
    assert!(size > 32 << 20, "{size}");

    let (mut child, line) = spawn_studio(out.path());
    let pid = child.id();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no URL in {line:?}"))
        .to_string();
    let addr: std::net::SocketAddr = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    // SIGPIPE is ignored process-wide (`SigIgn`, bit 13 - 1): whether a
    // hung-up client's last write gets EPIPE (a signal) or ECONNRESET
    // (none) is a race, so the downloads below cannot show it every time.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let ignored = status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .unwrap();
    assert_ne!(
        ignored & (1 << 12),
        0,
        "SIGPIPE is not ignored: SigIgn {ignored:x}"
    );
    let a = agent();
    let (_, g) = answer(a.get(format!("{url}api/pieces")).call());
    assert_eq!(g["pieces"][0]["name"], json!(name), "listed at start: {g}");
    let request =
        format!("GET /files/{name}.wav HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let open = || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut first = [0u8; 100];
        s.read_exact(&mut first).unwrap();
        assert!(
            first.starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&first)
        );
        s
    };
    // One download to warm up, then memory is measured.
    drop(open());
    std::thread::sleep(Duration::from_millis(200));
    let before = rss_of(pid);

    // 20 downloads that read 100 bytes and hang up (`curl | head -c 100`).
    for _ in 0..20 {
        drop(open());
    }
    // 20 at once that stall after 100 bytes, then hang up together.
    let stalled: Vec<_> = (0..20).map(|_| open()).collect();
    std::thread::sleep(Duration::from_millis(500));
    let during = rss_of(pid);
    drop(stalled);
    std::thread::sleep(Duration::from_millis(500));
    let alive = child.try_wait().unwrap();
    let (status, info) = answer(a.get(format!("{url}api/info")).call());
    // The whole file, and a 1 KiB range, are still right.
    let r = a.get(format!("{url}files/{name}.wav")).call().unwrap();
    let whole = r.status().as_u16();
    let got_hash = sha256(r.into_body().with_config().limit(1 << 30).reader());
    let r = a
        .get(format!("{url}files/{name}.wav"))
        .header("range", "bytes=1000000-1001023")
        .call()
        .unwrap();
    let part_status = r.status().as_u16();
    let part = r.into_body().read_to_vec().unwrap();
    let after = rss_of(pid);
    let _ = child.kill();
    let _ = child.wait();

    assert!(alive.is_none(), "the studio died: {alive:?}");
    assert_eq!(status, 200, "{info}");
    assert_eq!(whole, 200);
    assert_eq!(got_hash, wav_hash, "the whole WAV, byte for byte");
    assert_eq!(part_status, 206);
    assert_eq!(part, part_want);
    let file_mib = size as f64 / (1 << 20) as f64;
    eprintln!(
        "studio resident memory: {before:.0} MiB; {during:.0} MiB with 20 stalled downloads \
         of a {file_mib:.0} MiB WAV; {after:.0} MiB after"
    );
    assert!(
        during - before < file_mib,
        "20 open downloads took {:.0} MiB, more than the {file_mib:.0} MiB file",
        during - before
    );
}

#[test]
fn download_all_is_a_zip_of_every_file() {
    let _measured = MEASURED.read().unwrap_or_else(|e| e.into_inner());
    let (out, _server, base, a) = studio(|_| {});
    let (_, v) = submit(
        &a,
        &base,
        json!({ "tokens": 16, "num_samples": 2, "seed": 4 }),
    );
    let job = wait_job(
        &a,
        &base,
        v["id"].as_u64().unwrap(),
        Duration::from_secs(120),
    );
    assert_eq!(job.state, JobState::Done, "{:?}", job.error);
    let names_in = |zip: &[u8]| -> Vec<String> {
        // The central directory, from the end record.
        let end = zip.len() - 22;
        assert_eq!(&zip[end..end + 4], b"PK\x05\x06");
        let count = u16::from_le_bytes([zip[end + 10], zip[end + 11]]) as usize;
        let mut at = u32::from_le_bytes(zip[end + 16..end + 20].try_into().unwrap()) as usize;
        let mut names = Vec::new();
        for _ in 0..count {
            assert_eq!(&zip[at..at + 4], b"PK\x01\x02");
            let n = u16::from_le_bytes([zip[at + 28], zip[at + 29]]) as usize;
            names.push(String::from_utf8(zip[at + 46..at + 46 + n].to_vec()).unwrap());
            at += 46 + n;
        }
        names
    };
    let p = &job.pieces[0];
    let r = a
        .get(format!("{base}api/pieces/{}/zip", p.id))
        .call()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let disposition = r.headers()["content-disposition"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(
        disposition,
        format!("attachment; filename=\"{}.zip\"", p.name)
    );
    let zip = r
        .into_body()
        .with_config()
        .limit(1 << 30)
        .read_to_vec()
        .unwrap();
    let mut names = names_in(&zip);
    names.sort();
    let mut want: Vec<String> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{}.", p.name)))
        .collect();
    want.sort();
    assert_eq!(names, want);
    let midi = std::fs::read(out.path().join(format!("{}.mid", p.name))).unwrap();
    assert!(
        zip.windows(midi.len()).any(|w| w == midi),
        "the MIDI bytes, stored"
    );
    let (status, _, all) = get_bytes(&a, format!("{base}api/jobs/{}/zip", job.id));
    assert_eq!(status, 200);
    assert_eq!(names_in(&all).len(), 2 * want.len());
    let (status, _, _) = get_bytes(&a, format!("{base}api/pieces/999999/zip"));
    assert_eq!(status, 404);
}
