//! The studio in a real browser: headless Chromium driven over WebDriver
//! (chromedriver; Debian packages `chromium` and `chromium-driver`) uploads
//! a sample prompt, generates a short piece with a tiny model and a fixed
//! seed, plays its audio with the roll's playhead following, seeks by a
//! click on the roll, checks help on every control and no sideways
//! scrolling at 400 px and at desktop width, reloads during a long job and
//! finds it again, and cancels it; a corrupt upload shows the command
//! line's message. Skipped, saying why, where chromedriver or Chromium is
//! missing.
//!
//! `CADENZA_REQUIRE_BROWSER=1` (as `make browser-test` sets) fails instead.
//!
//! `CADENZA_STUDIO_SCREENSHOT=PATH` saves a screenshot of the page with the
//! result there (`make studio-screenshot` writes docs/studio.png);
//! `CADENZA_STUDIO_MODEL=DIR` uses that model instead of the tiny one.

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};
use support::{agent, options, start, wav_seconds};

const SAMPLE: &str = "oneills-reel-4-4.mid";
/// The W3C name of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// An executable: `$var` if set, else the first of `names` found on PATH.
fn find_program(var: &str, names: &[&str]) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH")?;
    names.iter().find_map(|n| {
        std::env::split_paths(&path)
            .map(|d| d.join(n))
            .find(|p| p.is_file())
    })
}

/// chromedriver, stopped (by its own handle) when dropped.
struct Driver {
    child: Child,
    base: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    fn start(program: &Path) -> Driver {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(program)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let driver = Driver {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let a = agent();
        let t0 = Instant::now();
        loop {
            if let Ok(r) = a.get(format!("{}/status", driver.base)).call() {
                if r.status().as_u16() == 200 {
                    return driver;
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "chromedriver is not answering"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// One browser session: the few WebDriver commands the test needs.
struct Browser {
    url: String,
    agent: ureq::Agent,
}

impl Browser {
    fn open(driver: &Driver, chromium: &Path) -> Browser {
        let agent = agent();
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,1100",
                         "--mute-audio", "--autoplay-policy=no-user-gesture-required"]
            }
        }}});
        let v = call(
            &agent,
            agent
                .post(format!("{}/session", driver.base))
                .send_json(caps),
        );
        let id = v["sessionId"].as_str().expect("a session").to_string();
        Browser {
            url: format!("{}/session/{id}", driver.base),
            agent,
        }
    }

    fn post(&self, path: &str, body: Value) -> Value {
        call(
            &self.agent,
            self.agent
                .post(format!("{}{path}", self.url))
                .send_json(body),
        )
    }

    fn goto(&self, url: &str) {
        self.post("/url", json!({ "url": url }));
    }

    fn find(&self, css: &str) -> String {
        let v = self.post("/element", json!({ "using": "css selector", "value": css }));
        v[ELEMENT].as_str().expect("an element").to_string()
    }

    fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css);
        if !css.contains("file") {
            self.post(&format!("/element/{e}/clear"), json!({}));
        }
        self.post(&format!("/element/{e}/value"), json!({ "text": text }));
    }

    fn click(&self, css: &str) {
        let e = self.find(css);
        self.post(&format!("/element/{e}/click"), json!({}));
    }

    /// Sets a form control's value as a user would (an `input` event follows).
    fn set(&self, css: &str, value: &str) {
        self.post(
            "/execute/sync",
            json!({ "script": "const e = document.querySelector(arguments[0]); e.value = arguments[1]; \
                e.dispatchEvent(new Event('input')); e.dispatchEvent(new Event('change'));",
                "args": [css, value] }),
        );
    }

    /// Resizes the window (CSS pixels, at a device scale of 1).
    fn resize(&self, width: u32, height: u32) {
        self.post("/window/rect", json!({ "width": width, "height": height }));
    }

    /// `[page width, viewport width]`: the page scrolls sideways when the
    /// first is larger.
    fn widths(&self) -> (u64, u64) {
        let v = self.js(
            "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]",
        );
        (v[0].as_u64().unwrap(), v[1].as_u64().unwrap())
    }

    fn js(&self, script: &str) -> Value {
        self.post("/execute/sync", json!({ "script": script, "args": [] }))
    }

    fn js_async(&self, script: &str) -> Value {
        self.post("/execute/async", json!({ "script": script, "args": [] }))
    }

    /// Runs `script` until it returns something truthy (at most `limit`).
    fn wait_for(&self, script: &str, limit: Duration) -> Value {
        let t0 = Instant::now();
        loop {
            let v = self.js(script);
            let truthy = match &v {
                Value::Null | Value::Bool(false) => false,
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return v;
            }
            assert!(t0.elapsed() < limit, "timed out waiting for: {script}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn screenshot(&self) -> Vec<u8> {
        let v = call(
            &self.agent,
            self.agent.get(format!("{}/screenshot", self.url)).call(),
        );
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap())
            .unwrap()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.agent.delete(&self.url).call();
    }
}

/// The `value` of a WebDriver answer; panics with the driver's message on an error.
fn call(_a: &ureq::Agent, r: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Value {
    let r = r.expect("chromedriver answers");
    let status = r.status().as_u16();
    let v: Value = r
        .into_body()
        .with_config()
        .limit(64 << 20)
        .read_json()
        .unwrap();
    assert_eq!(status, 200, "WebDriver error: {v}");
    v["value"].clone()
}

/// Says why the test cannot run: a skip, or a failure where a browser is required.
fn skip(why: &str) {
    if std::env::var_os("CADENZA_REQUIRE_BROWSER").is_some_and(|v| !v.is_empty() && v != "0") {
        panic!("studio_in_headless_chromium cannot run: {why}");
    }
    // Straight to stderr, past the test harness's capture: a skip is seen.
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED studio_in_headless_chromium: {why}"
    );
}

#[test]
fn studio_in_headless_chromium() {
    let Some(chromedriver) = find_program("CHROMEDRIVER", &["chromedriver"]) else {
        skip(
            "no chromedriver (install the Debian packages chromium and chromium-driver, \
             or set CHROMEDRIVER)",
        );
        return;
    };
    let Some(chromium) = find_program("CHROME", &["chromium", "chromium-browser", "google-chrome"])
    else {
        skip("no Chromium (install the Debian package chromium, or set CHROME)");
        return;
    };
    let out = tempfile::tempdir().unwrap();
    let mut opts = options(out.path());
    let custom_model = std::env::var_os("CADENZA_STUDIO_MODEL").filter(|v| !v.is_empty());
    if let Some(m) = &custom_model {
        opts.model = PathBuf::from(m);
    }
    let server = start(opts);
    let base = server.url();
    let driver = Driver::start(&chromedriver);
    let b = Browser::open(&driver, &chromium);
    let long = Duration::from_secs(120);

    b.goto(&base);
    b.wait_for("return document.body.dataset.ready === '1'", long);
    let samples = b.js("return [...document.querySelectorAll('#sample-select option')].length");
    assert_eq!(samples, json!(4), "three samples and the placeholder");

    // A corrupt file: the command line's message, on the page.
    let junk = out.path().join("broken.mid");
    std::fs::write(&junk, b"MThd but not really a MIDI file").unwrap();
    b.type_into("#prompt-file", junk.to_str().unwrap());
    let shown = b.wait_for(
        "return document.getElementById('prompt-error').textContent",
        long,
    );
    let bytes = std::fs::read(&junk).unwrap();
    let cli = cadenza::midi::parse_named(&bytes, Path::new("broken.mid"))
        .err()
        .unwrap()
        .to_string();
    assert_eq!(shown, json!(cli));

    // Upload a sample prompt.
    let sample = std::fs::canonicalize(Path::new("midi_samples").join(SAMPLE)).unwrap();
    b.type_into("#prompt-file", sample.to_str().unwrap());
    b.wait_for(
        "return document.getElementById('prompt-status').dataset.promptId",
        long,
    );
    let status = b.js("return document.getElementById('prompt-status').textContent");
    assert!(status.as_str().unwrap().contains(SAMPLE), "{status}");
    assert_eq!(
        b.js("return document.getElementById('prompt-error').hidden"),
        json!(true)
    );

    // Generate a short piece: a length in tokens, a fixed seed.
    let tokens = if custom_model.is_some() { "384" } else { "64" };
    b.type_into("#prompt_bars", "2");
    b.set("#length_unit", "tokens");
    b.set("#length", tokens);
    let hint = b.js("return document.getElementById('length-hint').textContent");
    assert!(hint.as_str().unwrap().starts_with("About "), "{hint}");
    b.type_into("#seed", "7");
    // as a set of tunes (the model may end the prompt's tune and begin another)
    b.click("#set");
    b.click("#generate");
    b.wait_for(
        "return document.querySelector('#results .piece') !== null",
        long,
    );
    let meta = b.js("return document.querySelector('#results .piece .meta').textContent");
    assert!(meta.as_str().unwrap().contains("a set of tunes"), "{meta}");
    let progress = b.js("return document.getElementById('progress-text').textContent");
    assert!(
        progress
            .as_str()
            .unwrap()
            .starts_with(&format!("done: {tokens} tokens")),
        "{progress}"
    );
    assert!(progress.as_str().unwrap().contains("seed 7"), "{progress}");
    assert_eq!(
        b.js("return document.getElementById('job-error').hidden"),
        json!(true)
    );
    assert_eq!(
        b.js("return document.querySelector('#results button.again').textContent"),
        json!("Again with seed 7")
    );

    // The audio element: a WAV of the right length, and it plays.
    let src = b.wait_for(
        "const a = document.querySelector('#results audio'); \
         return a.readyState >= 1 ? a.src : null",
        long,
    );
    let duration = b.js("return document.querySelector('#results audio').duration");
    let wav = agent()
        .get(src.as_str().unwrap())
        .call()
        .unwrap()
        .into_body()
        .with_config()
        .limit(1 << 30)
        .read_to_vec()
        .unwrap();
    let secs = wav_seconds(&wav);
    let duration = duration.as_f64().unwrap();
    assert!(secs > 1.0, "{secs} s");
    assert!(
        (duration - secs).abs() < 0.01,
        "audio element {duration} s, WAV {secs} s"
    );

    // The roll: drawn from the notes, its playhead follows the audio, a
    // click seeks, the prompt's end is marked.
    let roll = b.wait_for(
        "const s = document.querySelector('#results .roll-scroll'); \
         const c = s.querySelector('canvas'); \
         return s.dataset.ready ? [c.width, c.height] : null",
        long,
    );
    assert!(
        roll[0].as_u64().unwrap() > 200 && roll[1].as_u64().unwrap() >= 120,
        "{roll}"
    );
    let played = b.js_async(
        "const done = arguments[arguments.length - 1]; \
         const a = document.querySelector('#results audio'); \
         a.play().then(() => setTimeout(() => { const t = a.currentTime; a.pause(); \
           const h = document.querySelector('#results .playhead').style.transform; \
           done([t, h]); }, 600)).catch((e) => done(String(e)));",
    );
    let t = played[0].as_f64().unwrap_or(0.0);
    assert!(t > 0.0, "playing: {played}");
    let x: f64 = played[1]
        .as_str()
        .and_then(|h| {
            h.strip_prefix("translateX(")?
                .strip_suffix("px)")?
                .parse()
                .ok()
        })
        .unwrap_or(0.0);
    assert!(x > 0.0, "the playhead moved: {played}");
    b.click("#results .roll-canvas");
    let seeked = b.js_async(
        "const done = arguments[arguments.length - 1]; \
         const a = document.querySelector('#results audio'); \
         setTimeout(() => { const t = a.currentTime; a.pause(); a.currentTime = 0; done(t); }, 300);",
    );
    assert!(
        seeked.as_f64().is_some_and(|t| t > 0.5),
        "a click in the middle seeks: {seeked}"
    );
    // Statistics of the prompt and of the piece, side by side, folded away.
    assert_eq!(
        b.js("return document.querySelector('#results details.stats-fold').open"),
        json!(false)
    );
    let stats = b.js(
        "return [...document.querySelectorAll('#results table.stats tbody tr')]\
         .map((r) => r.children.length)",
    );
    assert_eq!(stats.as_array().unwrap().len(), 11, "{stats}");
    assert!(stats.as_array().unwrap().iter().all(|c| c == 3));
    let links = b.js(
        "return [...document.querySelectorAll('#results .downloads a')].map((a) => a.textContent)",
    );
    assert_eq!(
        links,
        json!([
            "all (zip)",
            "MIDI",
            "WAV",
            "roll picture",
            "tokens",
            "settings"
        ])
    );
    b.wait_for(
        "return document.querySelectorAll('#gallery .piece').length === 1",
        long,
    );
    // Every control says what it does.
    let unexplained = b.js("return [...document.querySelectorAll('#settings label')]\
         .filter((l) => !l.querySelector('.help')).map((l) => l.textContent)");
    assert_eq!(unexplained, json!([]));

    // No sideways scrolling on a phone (400 px) or at desktop width.
    for width in [400, 1280] {
        b.resize(width, 1100);
        std::thread::sleep(Duration::from_millis(300));
        let (page, view) = b.widths();
        assert!(
            page <= view,
            "at {width} px the page is {page} px wide (viewport {view})"
        );
    }

    if let Some(path) = std::env::var_os("CADENZA_STUDIO_SCREENSHOT").filter(|v| !v.is_empty()) {
        b.js("window.scrollTo(0, 0)");
        let png = b.screenshot();
        assert_eq!(&png[1..4], b"PNG");
        std::fs::write(&path, png).unwrap();
        eprintln!("screenshot: {}", Path::new(&path).display());
    }

    // "Continue this piece" makes the piece the next prompt.
    b.click("#results .piece button.continue");
    let status = b.wait_for(
        "const s = document.getElementById('prompt-status').textContent; \
         return s.includes('(piece)') ? s : null",
        long,
    );
    assert!(
        status
            .as_str()
            .unwrap()
            .contains("oneills-reel-4-4-seed7-1.mid"),
        "{status}"
    );

    // A long job shows its progress; a reload finds it again, with its
    // settings; "Cancel" stops it.
    b.set("#length", "8192");
    b.type_into("#num_samples", "4");
    b.click("#generate");
    let running = "const p = document.getElementById('progress'); \
         const t = document.getElementById('progress-text').textContent; \
         return p.dataset.state === 'running' && t.includes('tokens/s') ? t : null";
    b.wait_for(running, long);
    b.goto(&base);
    b.wait_for("return document.body.dataset.ready === '1'", long);
    let running = b.wait_for(running, long);
    assert!(
        running.as_str().unwrap().contains("/ 8192 tokens"),
        "{running}"
    );
    assert_eq!(
        b.js("return [document.getElementById('length').value, \
              document.getElementById('length_unit').value, \
              document.getElementById('num_samples').value]"),
        json!(["8192", "tokens", "4"])
    );
    let prompt = b.js("return document.getElementById('prompt-status').textContent");
    assert!(prompt.as_str().unwrap().contains("(piece)"), "{prompt}");
    b.click("#cancel");
    let note = b.wait_for(
        "return document.getElementById('job-error').textContent",
        long,
    );
    assert_eq!(note, json!("Cancelled."));
    assert_eq!(
        b.js("return document.getElementById('generate').disabled"),
        json!(false)
    );
    assert_eq!(
        b.js("return document.querySelectorAll('#gallery .piece').length"),
        json!(1)
    );
}
