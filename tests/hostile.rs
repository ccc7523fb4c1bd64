//! Hostile input and concurrent use (issue 11): every case builds its input
//! here, and every command that could hang runs as a child process with a
//! deadline (killed and failed when it passes).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cadenza::midi;
use cadenza::tokenizer::{dataset, Vocab};

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cadenza"))
}

/// Output of one run of the binary.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
    secs: f64,
    /// Peak resident memory seen while it ran (Linux VmHWM, sampled), in KiB.
    peak_kb: u64,
}

impl Run {
    fn all(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// Runs `cadenza ARGS` with a deadline: past it the child is killed and the
/// test fails (a hang is a failure, never a stuck test run).
fn run_limited(args: &[&str], deadline_s: f64) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let (out_p, err_p) = (dir.path().join("out"), dir.path().join("err"));
    let t0 = Instant::now();
    let mut child = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_p).unwrap())
        .stderr(std::fs::File::create(&err_p).unwrap())
        .spawn()
        .unwrap();
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_kb = 0u64;
    let status = loop {
        if let Ok(st) = std::fs::read_to_string(&status_file) {
            if let Some(kb) = st
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            {
                peak_kb = peak_kb.max(kb);
            }
        }
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed().as_secs_f64() > deadline_s {
            child.kill().ok();
            child.wait().ok();
            panic!("cadenza {args:?} still ran after {deadline_s} s: killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        code: status.code().unwrap_or(-1),
        stdout: std::fs::read_to_string(out_p).unwrap_or_default(),
        stderr: std::fs::read_to_string(err_p).unwrap_or_default(),
        secs: t0.elapsed().as_secs_f64(),
        peak_kb,
    }
}

/// `cadenza train` of a tiny model for `steps` steps on `data` into `out`.
fn tiny_train_args(data: &Path, out: &Path, steps: &str) -> Vec<String> {
    let mut a: Vec<String> = ["train", "--data", s(data), "-o", s(out)]
        .iter()
        .map(|x| x.to_string())
        .collect();
    for x in [
        "--preset",
        "tiny",
        "--steps",
        steps,
        "--seq-len",
        "16",
        "--batch",
        "2",
        "--device",
        "cpu",
        "--threads",
        "1",
    ] {
        a.push(x.to_string());
    }
    a
}

/// [`run_limited`] with owned arguments.
fn run_args(args: &[String], deadline_s: f64) -> Run {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    run_limited(&a, deadline_s)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A variable-length quantity as MIDI writes delta times.
fn vlq(mut v: u32) -> Vec<u8> {
    let mut out = vec![(v & 0x7f) as u8];
    v >>= 7;
    while v > 0 {
        out.insert(0, (v & 0x7f) as u8 | 0x80);
        v >>= 7;
    }
    out
}

/// A format-0 SMF from (delta, event bytes) pairs; EndOfTrack is added.
fn smf(division: u16, events: &[(u32, Vec<u8>)]) -> Vec<u8> {
    let mut track = Vec::new();
    for (d, e) in events {
        track.extend(vlq(*d));
        track.extend(e);
    }
    track.extend([0, 0xff, 0x2f, 0]);
    let mut out = b"MThd".to_vec();
    out.extend(6u32.to_be_bytes());
    out.extend(0u16.to_be_bytes());
    out.extend(1u16.to_be_bytes());
    out.extend(division.to_be_bytes());
    out.extend(b"MTrk");
    out.extend((track.len() as u32).to_be_bytes());
    out.extend(track);
    out
}

/// `n` notes, each after a gap of `delta` ticks.
fn notes_after_gaps(n: usize, delta: u32, division: u16) -> Vec<u8> {
    let mut ev = Vec::new();
    for _ in 0..n {
        ev.push((delta, vec![0x90, 60, 80]));
        ev.push((1, vec![0x80, 60, 0]));
    }
    smf(division, &ev)
}

/// A small ordinary piece: a C major scale at 480 ticks per quarter.
fn scale_bytes() -> Vec<u8> {
    let mut ev = Vec::new();
    for p in [60u8, 62, 64, 65, 67, 69, 71, 72] {
        ev.push((0, vec![0x90, p, 80]));
        ev.push((480, vec![0x80, p, 0]));
    }
    smf(480, &ev)
}

// ---------------------------------------------------------------- limits

#[test]
fn huge_delta_file_is_refused_fast_by_every_reader() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("gaps.mid");
    std::fs::write(&f, notes_after_gaps(2000, 0x0fff_ffff, 1)).unwrap();
    for cmd in ["inspect", "encode"] {
        let r = run_limited(&[cmd, s(&f)], 20.0);
        assert_eq!(r.code, 1, "{cmd}: {}", r.all());
        assert!(r.stderr.contains("gaps.mid"), "{cmd}: {}", r.stderr);
        assert!(r.stderr.contains("--max-quarters"), "{cmd}: {}", r.stderr);
        assert!(r.secs < 10.0, "{cmd} took {} s", r.secs);
    }
    // In a folder with a good file: the bad one is skipped, the rest tokenized.
    let dir = tmp.path().join("in");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(&f, dir.join("gaps.mid")).unwrap();
    std::fs::write(dir.join("good.mid"), scale_bytes()).unwrap();
    let out = tmp.path().join("ds");
    let r = run_limited(&["tokenize", s(&dir), "-o", s(&out)], 20.0);
    assert_eq!(r.code, 0, "{}", r.all());
    assert!(r.all().contains("skipped"), "{}", r.all());
    let ds = dataset::Dataset::open(&out).unwrap();
    assert_eq!(ds.pieces.len(), 1);
    // The library refuses one such note alone, and the limit can be raised.
    let one = notes_after_gaps(1, 0x0fff_ffff, 1);
    let e = midi::parse(&one).unwrap_err();
    assert!(e.contains("quarter notes"), "{e}");
    let raised = midi::Limits {
        max_quarters: u64::MAX,
        ..Default::default()
    };
    assert!(midi::parse_with(&one, &raised).is_ok());
}

#[test]
fn a_64_mb_file_is_refused_quickly_in_little_memory() {
    // 22 million running-status note events: the worst case per byte.
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("dense.mid");
    let mut track = vec![0u8, 0x90, 60, 64];
    let body: Vec<u8> = (0..88u8).flat_map(|k| [0, 21 + k, 64]).collect();
    while track.len() + body.len() < (64 << 20) - 40 {
        track.extend(&body);
    }
    track.extend([0, 0xff, 0x2f, 0]);
    let mut bytes = b"MThd\0\0\0\x06\0\0\0\x01\x01\xe0MTrk".to_vec();
    bytes.extend((track.len() as u32).to_be_bytes());
    bytes.extend(track);
    std::fs::write(&f, &bytes).unwrap();
    let r = run_limited(&["inspect", s(&f)], 30.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("dense.mid") && r.stderr.contains("--max-events"));
    println!("refused in {:.2} s, peak {} MiB", r.secs, r.peak_kb >> 10);
    assert!(r.secs < 5.0, "{} s", r.secs);
    assert!(r.peak_kb < 2 << 20, "{} KiB", r.peak_kb);
}

#[test]
fn token_and_event_limits_are_enforced_with_their_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("scale.mid");
    std::fs::write(&f, scale_bytes()).unwrap();
    let r = run_limited(&["encode", s(&f), "--max-tokens", "5"], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("--max-tokens") && r.stderr.contains("scale.mid"));
    let r = run_limited(&["encode", s(&f), "--max-events", "3"], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("--max-events") && r.stderr.contains("scale.mid"));
    let r = run_limited(&["encode", s(&f), "--max-file-mb", "0"], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("--max-file-mb") && r.stderr.contains("scale.mid"));
    let r = run_limited(&["encode", s(&f)], 20.0);
    assert_eq!(r.code, 0, "{}", r.all());
}

#[test]
fn devices_are_refused_without_reading_them() {
    for dev in ["/dev/zero", "/dev/urandom"] {
        if !Path::new(dev).exists() {
            println!("skipped {dev}: not present");
            continue;
        }
        for cmd in ["encode", "inspect"] {
            let r = run_limited(&[cmd, dev], 10.0);
            assert_eq!(r.code, 1, "{}", r.all());
            assert!(
                r.stderr.contains(dev) && r.stderr.contains("character device"),
                "{}",
                r.stderr
            );
        }
    }
}

fn mkfifo(p: &Path) -> bool {
    Command::new("mkfifo")
        .arg(p)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn fifo_in_a_folder_is_skipped_never_opened() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("in");
    std::fs::create_dir(&dir).unwrap();
    if !mkfifo(&dir.join("pipe.mid")) {
        println!("skipped: mkfifo is not available");
        return;
    }
    std::fs::write(dir.join("good.mid"), scale_bytes()).unwrap();
    let out = tmp.path().join("ds");
    let r = run_limited(&["tokenize", s(&dir), "-o", s(&out)], 20.0);
    assert_eq!(r.code, 0, "{}", r.all());
    assert!(
        r.stderr.contains("pipe.mid") && r.stderr.contains("FIFO"),
        "{}",
        r.stderr
    );
    assert_eq!(dataset::Dataset::open(&out).unwrap().pieces.len(), 1);
    // Given directly, and to encode: refused, not blocked on.
    let r = run_limited(&["encode", s(&dir.join("pipe.mid"))], 10.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("FIFO"), "{}", r.stderr);
}

#[test]
fn tokenize_with_only_bad_inputs_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("in");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("junk.mid"), b"not a midi file at all").unwrap();
    std::fs::write(dir.join("empty.mid"), smf(480, &[])).unwrap();
    let out = tmp.path().join("ds");
    let r = run_limited(&["tokenize", s(&dir), "-o", s(&out)], 20.0);
    assert_ne!(r.code, 0, "{}", r.all());
    assert!(r.stderr.contains("junk.mid") && r.stderr.contains("empty.mid"));
    // The path is named once: "skipped PATH: reason", not "PATH: PATH: reason".
    let junk = dir.join("junk.mid");
    assert_eq!(r.stderr.matches(s(&junk)).count(), 1, "{}", r.stderr);
    // Nothing is left behind: not even the folder the run made.
    assert!(!out.exists());
}

#[test]
fn division_zero_is_reported() {
    let bytes = smf(0, &[(0, vec![0x90, 60, 80]), (4, vec![0x80, 60, 0])]);
    let (_, report) = midi::parse(&bytes).unwrap();
    assert!(report.zero_division);
    assert!(report
        .warnings()
        .iter()
        .any(|w| w.contains("0 ticks per quarter")));
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("div0.mid");
    std::fs::write(&f, &bytes).unwrap();
    let r = run_limited(&["encode", s(&f)], 20.0);
    assert_eq!(r.code, 0);
    assert!(r.stderr.contains("div0.mid") && r.stderr.contains("0 ticks per quarter"));
}

// ---------------------------------------------------------------- outputs

#[test]
fn tokenize_never_replaces_a_dataset_or_run_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("in");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("a.mid"), scale_bytes()).unwrap();
    std::fs::write(dir.join("b.mid"), scale_bytes()).unwrap();
    let out = tmp.path().join("ds");
    let r = run_limited(&["tokenize", s(&dir), "-o", s(&out)], 20.0);
    assert_eq!(r.code, 0, "{}", r.all());
    let one = tmp.path().join("one.mid");
    std::fs::write(&one, scale_bytes()).unwrap();
    let r = run_limited(&["tokenize", s(&one), "-o", s(&out)], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(
        r.stderr.contains("holds a dataset of 2 pieces") && r.stderr.contains("--force"),
        "{}",
        r.stderr
    );
    assert_eq!(dataset::Dataset::open(&out).unwrap().pieces.len(), 2);
    let r = run_limited(&["tokenize", s(&one), "-o", s(&out), "--force"], 20.0);
    assert_eq!(r.code, 0, "{}", r.all());
    assert_eq!(dataset::Dataset::open(&out).unwrap().pieces.len(), 1);
    // A forced run that tokenizes nothing leaves the dataset there whole.
    let junk = tmp.path().join("junk.mid");
    std::fs::write(&junk, b"not a midi file").unwrap();
    let r = run_limited(&["tokenize", s(&junk), "-o", s(&out), "--force"], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert_eq!(dataset::Dataset::open(&out).unwrap().pieces.len(), 1);

    // A run folder keeps its vocabulary.
    let run = tmp.path().join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::write(run.join("config.json"), "{}").unwrap();
    std::fs::write(run.join("vocab.json"), "original").unwrap();
    let r = run_limited(&["tokenize", s(&one), "-o", s(&run)], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("run folder"), "{}", r.stderr);
    assert_eq!(
        std::fs::read_to_string(run.join("vocab.json")).unwrap(),
        "original"
    );
}

#[test]
fn decode_and_render_never_write_over_their_input() {
    let tmp = tempfile::tempdir().unwrap();
    let mid = tmp.path().join("p.mid");
    std::fs::write(&mid, scale_bytes()).unwrap();
    let r = run_limited(&["encode", s(&mid)], 20.0);
    let t = tmp.path().join("t.txt");
    std::fs::write(&t, &r.stdout).unwrap();
    let r = run_limited(&["decode", s(&t), "-o", s(&t)], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("refusing to overwrite"), "{}", r.stderr);
    assert!(std::fs::read_to_string(&t).unwrap().starts_with("Bar"));
    // Through another spelling of the same path, and through a hard link.
    let other = format!("{}/../{}/t.txt", s(tmp.path()), {
        tmp.path().file_name().unwrap().to_str().unwrap()
    });
    let r = run_limited(&["decode", s(&t), "-o", &other], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    let link = tmp.path().join("link.txt");
    std::fs::hard_link(&t, &link).unwrap();
    let r = run_limited(&["decode", s(&t), "-o", s(&link)], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    // render -o onto its input MIDI, and --png onto -o.
    let r = run_limited(&["render", s(&mid), "-o", s(&mid)], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    let wav = tmp.path().join("x.wav");
    let r = run_limited(&["render", s(&mid), "-o", s(&wav), "--png", s(&wav)], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("same file"), "{}", r.stderr);
    assert_eq!(std::fs::read(&mid).unwrap(), scale_bytes());
}

#[test]
fn failed_atomic_write_leaves_no_temporary_file() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("folder");
    std::fs::create_dir(&target).unwrap();
    let e = cadenza::util::write_atomic(&target, b"x").unwrap_err();
    assert!(format!("{e:#}").contains("is a folder"), "{e:#}");
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "{left:?}");
    // Stale temporary files of a dead process are cleaned; ours and live
    // processes' are kept.
    let dead = dead_pid();
    let stale_file = tmp.path().join(format!(".metrics.jsonl.{dead}.tmp"));
    let stale_dir = tmp.path().join(format!(".checkpoint.tmp-{dead}"));
    let mine = tmp.path().join(format!(".x.{}.tmp", std::process::id()));
    std::fs::write(&stale_file, b"x").unwrap();
    std::fs::create_dir(&stale_dir).unwrap();
    std::fs::write(stale_dir.join("model.safetensors"), b"x").unwrap();
    std::fs::write(&mine, b"x").unwrap();
    let removed = cadenza::util::clean_stale_temps(tmp.path());
    assert_eq!(removed.len(), 2, "{removed:?}");
    assert!(!stale_file.exists() && !stale_dir.exists() && mine.exists());
}

/// The pid of a process that has exited.
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

// ---------------------------------------------------------------- panics

/// Byte range of the `pdta` (preset data) list of an SF2 file.
fn pdta_range(sf2: &[u8]) -> Option<(usize, usize)> {
    let at = sf2.windows(4).position(|w| w == b"pdta")?;
    // "LIST" <len> "pdta": the length is the 4 bytes before the tag.
    let len = u32::from_le_bytes(sf2[at - 4..at].try_into().ok()?) as usize;
    Some((at + 4, (at + len).min(sf2.len())))
}

#[test]
fn corrupt_soundfont_is_an_error_naming_it_never_a_panic() {
    let Some(sf) = cadenza::render::KNOWN_SOUNDFONTS
        .iter()
        .map(Path::new)
        .find(|p| p.is_file())
    else {
        println!("skipped: no SoundFont installed");
        return;
    };
    let good = std::fs::read(sf).unwrap();
    let Some((lo, hi)) = pdta_range(&good) else {
        println!("skipped: {} has no pdta chunk", sf.display());
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (score, _) = midi::parse(&scale_bytes()).unwrap();
    let opts = cadenza::render::RenderOptions {
        tail_seconds: 0.1,
        ..Default::default()
    };
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let (mut errors, mut crashed_before) = (0, 0);
    for k in 0..24 {
        let mut bad = good.clone();
        for _ in 0..30 {
            let at = lo + (next() as usize) % (hi - lo);
            bad[at] = next() as u8;
        }
        let p = tmp.path().join(format!("mutant{k}.sf2"));
        std::fs::write(&p, &bad).unwrap();
        // Would rustysynth itself panic on this mutant?
        let raw = std::panic::catch_unwind(|| {
            let f = std::fs::File::open(&p).unwrap();
            let sf = rustysynth::SoundFont::new(&mut std::io::BufReader::new(f));
            if let Ok(sf) = sf {
                let sf = std::sync::Arc::new(sf);
                let st = rustysynth::SynthesizerSettings::new(44_100);
                if let Ok(mut syn) = rustysynth::Synthesizer::new(&sf, &st) {
                    for prog in 0..128 {
                        syn.process_midi_message(0, 0xC0, prog, 0);
                        syn.note_on(0, 60, 100);
                        let (mut l, mut r) = (vec![0f32; 64], vec![0f32; 64]);
                        syn.render(&mut l, &mut r);
                        syn.note_off_all(true);
                    }
                }
            }
        });
        crashed_before += raw.is_err() as usize;
        match cadenza::render::render_samples(&score, &p, &opts) {
            Ok(_) => {}
            Err(e) => {
                let msg = format!("{e:#}");
                assert!(msg.contains(&format!("mutant{k}.sf2")), "{msg}");
                errors += 1;
            }
        }
    }
    println!("24 mutants: {crashed_before} make rustysynth panic, {errors} refused with an error");
    // The command line: an error naming the .sf2, exit status 1, never 101.
    let mid = tmp.path().join("p.mid");
    std::fs::write(&mid, scale_bytes()).unwrap();
    for k in 0..24 {
        let p = tmp.path().join(format!("mutant{k}.sf2"));
        let wav = tmp.path().join("o.wav");
        let r = run_limited(
            &["render", s(&mid), "-o", s(&wav), "--soundfont", s(&p)],
            60.0,
        );
        assert!(r.code == 0 || r.code == 1, "mutant{k}: {}", r.all());
        assert!(!r.stderr.contains("panicked"), "mutant{k}: {}", r.stderr);
        if r.code == 1 {
            assert!(r.stderr.contains(&format!("mutant{k}.sf2")), "{}", r.stderr);
        }
    }
}

/// A dataset of the scale, with `tokens.bin` patched to hold `id` once.
fn dataset_with_id(dir: &Path, id: u16) -> PathBuf {
    let mdir = dir.join("m");
    std::fs::create_dir_all(&mdir).unwrap();
    std::fs::write(mdir.join("a.mid"), scale_bytes()).unwrap();
    let vocab = Vocab::new(Default::default()).unwrap();
    let files = dataset::collect_midi_files(&[mdir]).unwrap();
    let results = dataset::tokenize_files(&files, &vocab, &|| {});
    let out = dir.join("ds");
    dataset::write_dataset(&out, &vocab, &files, results).unwrap();
    let bin = out.join(dataset::TOKENS_FILE);
    let mut bytes = std::fs::read(&bin).unwrap();
    bytes[4..6].copy_from_slice(&id.to_le_bytes());
    std::fs::write(&bin, bytes).unwrap();
    out
}

#[test]
fn dataset_ids_outside_the_vocabulary_are_refused_naming_tokens_bin() {
    let tmp = tempfile::tempdir().unwrap();
    let vocab = Vocab::new(Default::default()).unwrap();
    let ds = dataset_with_id(tmp.path(), vocab.len() as u16);
    let e = dataset::Dataset::open(&ds).err().expect("refused");
    let msg = format!("{e:#}");
    assert!(
        msg.contains("tokens.bin") && msg.contains("outside the vocabulary"),
        "{msg}"
    );
    // stats (and train, below) go through Dataset::open.
    let mid = tmp.path().join("g.mid");
    std::fs::write(&mid, scale_bytes()).unwrap();
    let r = run_limited(&["stats", s(&mid), "--real", s(&ds)], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("tokens.bin"), "{}", r.stderr);
    let run = tmp.path().join("run");
    let r = run_args(&tiny_train_args(&ds, &run, "2"), 60.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("tokens.bin"), "{}", r.stderr);
}

// ---------------------------------------------------------------- runs and models

/// libtorch's random generator is global to the process: tests that train
/// in this process take turns.
static TORCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn torch() -> std::sync::MutexGuard<'static, ()> {
    TORCH.lock().unwrap_or_else(|e| e.into_inner())
}

/// A dataset of a few scales in different keys.
fn scales_dataset(dir: &Path) -> PathBuf {
    common::scales_dataset(dir, "scales", 6, 48)
}

fn tiny_opts(run: &Path, data: &Path) -> cadenza::train::TrainOptions {
    cadenza::train::TrainOptions {
        run_dir: run.to_path_buf(),
        data: Some(data.to_path_buf()),
        preset: Some("tiny".into()),
        steps: Some(2),
        seq_len: Some(16),
        batch: Some(2),
        seed: Some(1),
        device: Some("cpu".into()),
        threads: Some(1),
        ..Default::default()
    }
}

/// A trained 2-step tiny run and its dataset.
fn tiny_run(dir: &Path) -> (PathBuf, PathBuf) {
    let data = scales_dataset(dir);
    let run = dir.join("run");
    cadenza::train::train(&tiny_opts(&run, &data)).unwrap();
    (run, data)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

fn edit_config(run: &Path, f: impl Fn(&mut serde_json::Value)) {
    let p = run.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn load_err(run: &Path) -> String {
    match cadenza::train::checkpoint::load_model(run, tch::Device::Cpu) {
        Ok(_) => panic!("{} loaded", run.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn model_folders_are_checked_against_their_config() {
    let _t = torch();
    let tmp = tempfile::tempdir().unwrap();
    let (run, _) = tiny_run(tmp.path());
    assert!(cadenza::train::checkpoint::load_model(&run, tch::Device::Cpu).is_ok());

    // Fewer layers in config.json than in the weights.
    let fewer = tmp.path().join("fewer");
    copy_dir(&run, &fewer);
    edit_config(&fewer, |v| v["model"]["n_layers"] = 1.into());
    let e = load_err(&fewer);
    assert!(e.contains("2 layer(s)") && e.contains("describes 1"), "{e}");
    assert!(
        e.contains("model.safetensors") && e.contains("config.json"),
        "{e}"
    );

    // A narrower d_model: a shape, named, never a C++ trace (CLI too).
    let narrow = tmp.path().join("narrow");
    copy_dir(&run, &narrow);
    edit_config(&narrow, |v| v["model"]["d_model"] = 32.into());
    let e = load_err(&narrow);
    assert!(e.contains("tensor") && e.contains("d_model"), "{e}");
    let out = tmp.path().join("g.mid");
    let r = run_limited(
        &[
            "generate",
            "--model",
            s(&narrow),
            "-o",
            s(&out),
            "--tokens",
            "4",
            "--device",
            "cpu",
        ],
        60.0,
    );
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(
        r.stderr.contains("model.safetensors") && !r.stderr.contains("Exception raised"),
        "{}",
        r.stderr
    );

    // d_model = 0: the config's own check, naming it.
    let zero = tmp.path().join("zero");
    copy_dir(&run, &zero);
    edit_config(&zero, |v| v["model"]["d_model"] = 0.into());
    let e = load_err(&zero);
    assert!(e.contains("config.json") && e.contains("d_model"), "{e}");

    // Non-finite weights.
    for (name, value) in [("nan", f64::NAN), ("inf", f64::INFINITY)] {
        let bad = tmp.path().join(name);
        copy_dir(&run, &bad);
        let m = cadenza::train::checkpoint::load_model(&bad, tch::Device::Cpu).unwrap();
        tch::no_grad(|| {
            for (_, mut t) in m.vs.variables() {
                let _ = t.fill_(value);
            }
        });
        m.vs.save(m.dir.join("model.safetensors")).unwrap();
        let e = load_err(&bad);
        assert!(
            e.contains("NaN or infinite") && e.contains("model.safetensors"),
            "{e}"
        );
    }
}

#[test]
fn resume_needs_its_checkpoint_and_features() {
    let _t = torch();
    let tmp = tempfile::tempdir().unwrap();
    let (run, data) = tiny_run(tmp.path());
    let resume = |dir: &Path| {
        let mut o = tiny_opts(dir, &data);
        o.resume = true;
        o.preset = None;
        o.seq_len = None;
        o.batch = None;
        o.steps = Some(4);
        o.extend = true;
        cadenza::train::train(&o)
    };
    let no_features = tmp.path().join("nofeat");
    copy_dir(&run, &no_features);
    std::fs::remove_file(no_features.join("checkpoint/train_features.safetensors")).unwrap();
    let e = format!("{:#}", resume(&no_features).err().unwrap());
    assert!(e.contains("train_features.safetensors"), "{e}");

    let no_ckpt = tmp.path().join("nockpt");
    copy_dir(&run, &no_ckpt);
    std::fs::remove_dir_all(no_ckpt.join("checkpoint")).unwrap();
    let e = format!("{:#}", resume(&no_ckpt).err().unwrap());
    assert!(e.contains("no checkpoint"), "{e}");
    let e = format!("{:#}", resume(&tmp.path().join("absent")).err().unwrap());
    assert!(e.contains("not a run folder"), "{e}");
}

#[test]
fn a_run_folder_is_locked_while_a_process_trains_in_it() {
    let _t = torch();
    let tmp = tempfile::tempdir().unwrap();
    let (run, data) = tiny_run(tmp.path());
    assert!(!run.join("train.lock").exists(), "the lock is released");
    let resume = || {
        let mut o = tiny_opts(&run, &data);
        o.resume = true;
        o.preset = None;
        o.seq_len = None;
        o.batch = None;
        o.steps = Some(4);
        o.extend = true;
        cadenza::train::train(&o)
    };
    // Held by a live process: refused, naming it.
    let mut holder = Command::new("sleep").arg("30").spawn().unwrap();
    std::fs::write(run.join("train.lock"), format!("{}\n", holder.id())).unwrap();
    let e = format!("{:#}", resume().err().unwrap());
    holder.kill().ok();
    holder.wait().ok();
    assert!(e.contains(&format!("process {}", holder.id())), "{e}");
    // Two runs started into one new folder: the second is refused (the CLI).
    let fresh = tmp.path().join("fresh");
    std::fs::create_dir(&fresh).unwrap();
    let mut holder = Command::new("sleep").arg("30").spawn().unwrap();
    std::fs::write(fresh.join("train.lock"), format!("{}\n", holder.id())).unwrap();
    let r = run_args(&tiny_train_args(&data, &fresh, "2"), 60.0);
    holder.kill().ok();
    holder.wait().ok();
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("is in use"), "{}", r.stderr);
    assert!(!fresh.join("config.json").exists());

    // Two real processes: the second is refused with the first one's pid.
    let both = tmp.path().join("both");
    let args = |dir: &Path| tiny_train_args(&data, dir, "100000");
    let mut first = Command::new(bin())
        .args(args(&both))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !both.join("train.lock").exists() && t0.elapsed().as_secs() < 30 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let second: Vec<String> = args(&both);
    let second: Vec<&str> = second.iter().map(|a| a.as_str()).collect();
    let r = run_limited(&second, 60.0);
    first.kill().ok();
    first.wait().ok();
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(
        r.stderr.contains(&format!("process {}", first.id())),
        "{}",
        r.stderr
    );

    // A stale lock and stale temporaries of a killed run: taken over, cleaned.
    let dead = dead_pid();
    std::fs::write(run.join("train.lock"), format!("{dead}\n")).unwrap();
    let stale = run.join(format!(".checkpoint.tmp-{dead}"));
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("model.safetensors"), vec![0u8; 1000]).unwrap();
    let stale_file = run.join(format!(".metrics.jsonl.{dead}.tmp"));
    std::fs::write(&stale_file, b"{}").unwrap();
    let s = resume().unwrap();
    assert_eq!(s.steps_done, 4);
    assert!(!stale.exists() && !stale_file.exists());
    assert!(!run.join("train.lock").exists());
}

#[test]
fn bad_training_settings_are_refused_naming_their_source() {
    let _t = torch();
    let tmp = tempfile::tempdir().unwrap();
    let data = scales_dataset(tmp.path());
    let err = |f: &dyn Fn(&mut cadenza::train::TrainOptions)| {
        let mut o = tiny_opts(&tmp.path().join("r"), &data);
        f(&mut o);
        let e = format!("{:#}", cadenza::train::train(&o).expect_err("refused"));
        std::fs::remove_dir_all(tmp.path().join("r")).ok();
        e
    };
    let e = err(&|o| o.run_dir = data.clone());
    assert!(e.contains("is the --data folder"), "{e}");
    assert!(dataset::Dataset::open(&data).is_ok());
    assert!(!data.join("config.json").exists());
    let e = err(&|o| o.steps = Some(0));
    assert!(e.contains("steps must be at least 1"), "{e}");
    let e = err(&|o| o.lr = Some(-1.0));
    assert!(
        e.contains("lr must be a positive") && e.contains("command-line"),
        "{e}"
    );
    let e = err(&|o| {
        o.lr = Some(1e30);
        o.steps = Some(4);
    });
    assert!(
        e.contains("training diverged") && e.contains("config.json") && e.contains("--lr"),
        "{e}"
    );
    let e = err(&|o| o.seq_len = Some(1_000_000));
    assert!(e.contains("--seq-len 1000000") && e.contains("data"), "{e}");
    let cfg = tmp.path().join("bad.toml");
    std::fs::write(&cfg, "[model]\nd_model = 0\n").unwrap();
    let e = err(&|o| o.config_file = Some(cfg.clone()));
    assert!(e.contains("bad.toml") && e.contains("d_model"), "{e}");
    // Tokenizer configs: the file and the right reason.
    for (text, want) in [
        ("positions_per_quarter = 0\n", "positions_per_quarter"),
        (
            "pitch_min = 90\npitch_max = 30\n",
            "pitch_min (90) must not be above pitch_max (30)",
        ),
    ] {
        let p = tmp.path().join("tok.toml");
        std::fs::write(&p, text).unwrap();
        let out = tmp.path().join("v.json");
        let r = run_limited(&["vocab", "--config", s(&p), "-o", s(&out)], 20.0);
        assert_eq!(r.code, 1, "{}", r.all());
        assert!(
            r.stderr.contains("tok.toml") && r.stderr.contains(want),
            "{}",
            r.stderr
        );
    }
}

#[test]
fn generate_guards_its_inputs_outputs_and_memory() {
    let _t = torch();
    let tmp = tempfile::tempdir().unwrap();
    let (run, data) = tiny_run(tmp.path());
    let p = tmp.path().join("p.mid");
    std::fs::write(&p, scale_bytes()).unwrap();
    let gen = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            s(&run),
            "--tokens",
            "8",
            "--device",
            "cpu",
        ];
        args.extend_from_slice(extra);
        run_limited(&args, 60.0)
    };
    for extra in [
        vec!["--prompt", s(&p), "-o", s(&p)],
        vec![
            "--prompt",
            s(&p),
            "-o",
            s(&tmp.path().join("y.mid")),
            "--tokens-out",
            s(&p),
        ],
    ] {
        let r = gen(&extra);
        assert_eq!(r.code, 1, "{}", r.all());
        assert!(
            r.stderr.contains("refusing to overwrite an input"),
            "{}",
            r.stderr
        );
    }
    // Nor over the model's own files.
    let r = gen(&["-o", s(&run.join("config.json"))]);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("--model"), "{}", r.stderr);
    let x = tmp.path().join("x");
    for flag in ["--png", "--wav", "--tokens-out"] {
        let r = gen(&["-o", s(&x), flag, s(&x)]);
        assert_eq!(r.code, 1, "{flag}: {}", r.all());
        assert!(r.stderr.contains("same file"), "{flag}: {}", r.stderr);
        assert!(!x.exists());
    }
    // Numbered outputs collide too: with 2 samples both are a-1.mid, a-2.mid.
    let a = tmp.path().join("a.mid");
    let a1 = tmp.path().join("a-1.mid");
    let r = gen(&["-o", s(&a), "--num-samples", "2", "--tokens-out", s(&a)]);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("a-1.mid"), "{}", r.stderr);
    assert_eq!(std::fs::read(&p).unwrap(), scale_bytes());
    // The record beside a piece (OUT.json) is an output like the others: not
    // over the model's sampling defaults, nor over another output.
    let defaults = run.join("generation_config.json");
    let before = std::fs::read(&defaults).unwrap();
    let r = gen(&["-o", s(&run.join("generation_config.mid"))]);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(
        r.stderr.contains("refusing to overwrite an input"),
        "{}",
        r.stderr
    );
    assert_eq!(std::fs::read(&defaults).unwrap(), before);
    let j = tmp.path().join("j.json");
    let r = gen(&["-o", s(&tmp.path().join("j.mid")), "--tokens-out", s(&j)]);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("same file"), "{}", r.stderr);
    assert!(!j.exists());
    // A corrupt generation_config.json is an error that names it, never a panic.
    for bad in ["\u{0}\u{1}garbage", "[1, 2]", r#"{"temperature": -1}"#] {
        std::fs::write(&defaults, bad).unwrap();
        let r = gen(&["-o", s(&a)]);
        assert_eq!(r.code, 1, "{bad}: {}", r.all());
        assert!(
            r.stderr.contains("generation_config.json"),
            "{bad}: {}",
            r.stderr
        );
        assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    }
    std::fs::write(&defaults, &before).unwrap();

    // A prompt with a 0x0FFFFFFF-tick gap at division 1: refused, fast.
    let gaps = tmp.path().join("gaps.mid");
    std::fs::write(&gaps, notes_after_gaps(2000, 0x0fff_ffff, 1)).unwrap();
    let r = gen(&["--prompt", s(&gaps), "-o", s(&a)]);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("gaps.mid") && r.stderr.contains("--max-quarters"));
    assert!(r.secs < 30.0, "{} s", r.secs);

    let r = gen(&["--prompt", s(&p), "--prompt-bars", "0", "-o", s(&a)]);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("--prompt-bars 0"), "{}", r.stderr);

    // 100,000 notes at one tick: refused quickly, naming the file.
    let mut ev = Vec::new();
    for i in 0..100_000u32 {
        ev.push((0, vec![0x90, 21 + (i % 88) as u8, 80]));
    }
    ev.push((480, vec![0x80, 60, 0]));
    let chord = tmp.path().join("chord.mid");
    std::fs::write(&chord, smf(480, &ev)).unwrap();
    let r = gen(&["--prompt", s(&chord), "-o", s(&a)]);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(
        r.stderr.contains("chord.mid") && r.stderr.contains("--max-prompt-tokens"),
        "{}",
        r.stderr
    );
    assert!(r.secs < 30.0, "{} s", r.secs);

    let r = run_limited(
        &[
            "generate",
            "--model",
            s(&run),
            "--device",
            "cpu",
            "--num-samples",
            "100000",
            "-o",
            s(&a),
            "--max-memory-mb",
            "2048",
        ],
        60.0,
    );
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("--max-memory-mb"), "{}", r.stderr);
    let r = gen(&["--num-samples", "2", "-o", s(&a), "--max-memory-mb", "0"]);
    assert_eq!(r.code, 1, "{}", r.all());
    let r = gen(&["--num-samples", "2", "-o", s(&a)]);
    assert_eq!(r.code, 0, "{}", r.all());
    assert!(a1.exists());

    // eval on a dataset with an id past the vocabulary: an error naming tokens.bin.
    let bad = tmp.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    let bad_ds = dataset_with_id(
        &bad,
        Vocab::new(Default::default()).unwrap().len() as u16 + 7,
    );
    let r = run_limited(
        &[
            "eval",
            "--model",
            s(&run),
            "--data",
            s(&bad_ds),
            "--device",
            "cpu",
            "--json",
            s(&tmp.path().join("e.json")),
        ],
        60.0,
    );
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("tokens.bin"), "{}", r.stderr);
    let _ = data;
}

// ---------------------------------------------------------------- MIDI writer

/// (start tick, pitch, program, duration) of every note of a MIDI file, read
/// as players and other readers do: all tracks merged in time (ties in track
/// order); per channel, the last program change before a note-on decides its
/// program, and a note-off ends the earliest sounding note of its pitch on
/// its channel. Drums are reported as program 128.
fn notes_by_channel_rule(bytes: &[u8]) -> Vec<(u64, u8, u8, u64)> {
    let smf = midly::Smf::parse(bytes).unwrap();
    let mut evs = Vec::new();
    for (ti, t) in smf.tracks.iter().enumerate() {
        let mut tick = 0u64;
        for (ei, e) in t.iter().enumerate() {
            tick += e.delta.as_int() as u64;
            evs.push((tick, ti, ei, e.kind));
        }
    }
    evs.sort_by_key(|&(t, ti, ei, _)| (t, ti, ei));
    let mut program = [0u8; 16];
    let mut open: std::collections::HashMap<(usize, u8), std::collections::VecDeque<(u64, u8)>> =
        Default::default();
    let mut out = Vec::new();
    for (tick, _, _, kind) in evs {
        if let midly::TrackEventKind::Midi { channel, message } = kind {
            let ch = channel.as_int() as usize;
            match message {
                midly::MidiMessage::ProgramChange { program: p } => program[ch] = p.as_int(),
                midly::MidiMessage::NoteOn { key, vel } if vel.as_int() > 0 => {
                    let p = if ch == 9 { 128 } else { program[ch] };
                    open.entry((ch, key.as_int()))
                        .or_default()
                        .push_back((tick, p));
                }
                midly::MidiMessage::NoteOn { key, .. }
                | midly::MidiMessage::NoteOff { key, .. } => {
                    if let Some((start, p)) = open
                        .get_mut(&(ch, key.as_int()))
                        .and_then(|q| q.pop_front())
                    {
                        out.push((start, key.as_int(), p, tick - start));
                    }
                }
                _ => {}
            }
        }
    }
    out.sort();
    out
}

fn note_keys(notes: &[midi::Note]) -> Vec<(u64, u8, u8, u64)> {
    let mut v: Vec<_> = notes
        .iter()
        .map(|n| {
            (
                n.start,
                n.pitch,
                if n.is_drum { 128 } else { n.program },
                n.duration,
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn more_than_15_programs_each_keep_their_program() {
    // 20 programs (plus drums): in turn, then all at once (more than 15
    // sounding together), then in overlapping pairs.
    let mut sc = midi::Score::new(480);
    let note = |start: u64, duration: u64, pitch: u8, program: u8| midi::Note {
        start,
        duration,
        pitch,
        velocity: 80,
        program,
        channel: 0,
        is_drum: false,
    };
    for k in 0..20u8 {
        sc.notes.push(note(k as u64 * 480, 480, 40 + k, k * 6));
        sc.notes.push(note(20 * 480, 960, 40 + k, k * 6));
        sc.notes
            .push(note(30 * 480 + k as u64 * 240, 480, 60 + k, k * 6));
        sc.notes
            .push(note(30 * 480 + k as u64 * 240, 120, 61 + k, k * 6));
    }
    for i in 0..40u64 {
        sc.notes.push(midi::Note {
            is_drum: true,
            channel: 9,
            program: 0,
            ..note(i * 480, 120, 36, 0)
        });
    }
    sc.sort();
    let bytes = midi::to_bytes(&sc).unwrap();
    let want = note_keys(&sc.notes);
    assert_eq!(notes_by_channel_rule(&bytes), want);
    // Our reader (per track) agrees.
    let (back, _) = midi::parse(&bytes).unwrap();
    assert_eq!(note_keys(&back.notes), want);
    // At most 15 programs: one channel each, as before.
    let mut sc15 = midi::Score::new(480);
    sc15.notes = sc
        .notes
        .iter()
        .filter(|n| n.is_drum || n.program < 15 * 6)
        .copied()
        .collect();
    let bytes = midi::to_bytes(&sc15).unwrap();
    assert_eq!(notes_by_channel_rule(&bytes), note_keys(&sc15.notes));
}

// ---------------------------------------------------------------- bounded fuzzing

/// Runs `cases` inputs of `strategy` through `check` with a fixed seed (the
/// same inputs every run) and prints how many ran. A panic inside `check`
/// fails the test with the (shrunk) input.
fn fuzz<S: proptest::strategy::Strategy>(
    name: &str,
    cases: u32,
    strategy: S,
    check: impl Fn(S::Value) -> bool,
) where
    S::Value: std::fmt::Debug,
{
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 200,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let count = std::cell::Cell::new(0usize);
    let accepted = std::cell::Cell::new(0usize);
    let t0 = Instant::now();
    runner
        .run(&strategy, |v| {
            count.set(count.get() + 1);
            accepted.set(accepted.get() + check(v) as usize);
            Ok(())
        })
        .unwrap();
    println!(
        "fuzz {name}: {} inputs ({} accepted, the rest refused with an error) in {:.2} s, no panic",
        count.get(),
        accepted.get(),
        t0.elapsed().as_secs_f64()
    );
}

/// (position, byte) edits applied to `base`.
fn mutated(base: &[u8], edits: &[(usize, u8)]) -> Vec<u8> {
    let mut b = base.to_vec();
    for &(at, v) in edits {
        if !b.is_empty() {
            let i = at % b.len();
            b[i] = v;
        }
    }
    b
}

#[test]
fn fuzz_midi_reader() {
    use proptest::prelude::*;
    // Raw bytes behind a valid header and a track chunk of matching length.
    fuzz(
        "MIDI reader (random tracks)",
        3000,
        proptest::collection::vec(any::<u8>(), 0..400),
        |body| {
            let mut b = b"MThd\0\0\0\x06\0\x01\0\x01\x01\xe0MTrk".to_vec();
            b.extend((body.len() as u32).to_be_bytes());
            b.extend(&body);
            match midi::parse(&b) {
                Ok((score, _)) => midi::to_bytes(&score).is_ok(),
                Err(_) => false,
            }
        },
    );
    // A real file with bytes changed anywhere (header, lengths, events).
    let base = std::fs::read("midi_samples/oneills-jig-6-8.mid").unwrap_or_else(|_| scale_bytes());
    let vocab = Vocab::new(Default::default()).unwrap();
    fuzz(
        "MIDI reader (mutated file)",
        2000,
        proptest::collection::vec((any::<usize>(), any::<u8>()), 1..12),
        |edits| {
            let b = mutated(&base, &edits);
            match midi::parse(&b) {
                Ok((score, _)) => {
                    let (ids, _) = cadenza::tokenizer::encode(&score, &vocab);
                    let _ = cadenza::tokenizer::decode(&ids, &vocab);
                    true
                }
                Err(_) => false,
            }
        },
    );
}

#[test]
fn fuzz_token_decoder() {
    let vocab = Vocab::new(Default::default()).unwrap();
    let n = vocab.len() as u32;
    fuzz(
        "token decoder",
        3000,
        proptest::collection::vec(0..n + 40, 0..300),
        |ids| {
            let (score, _) = cadenza::tokenizer::decode(&ids, &vocab);
            let out = cadenza::tokenizer::to_output_resolution(&score);
            match midi::to_bytes(&out) {
                Ok(bytes) => {
                    midi::parse(&bytes).expect("what we write reads back");
                    true
                }
                Err(_) => false,
            }
        },
    );
}

#[test]
fn fuzz_json_and_toml_loaders() {
    use proptest::prelude::any;
    let tmp = tempfile::tempdir().unwrap();
    // The vocabulary file.
    let vocab = Vocab::new(Default::default()).unwrap();
    let vpath = tmp.path().join("vocab.json");
    vocab.save(&vpath).unwrap();
    let vtext = std::fs::read(&vpath).unwrap();
    let chars = b"{}[]\":,.-0123456789truefalsnul aeiz\n";
    let edit = (any::<usize>(), proptest::sample::select(chars.to_vec()));
    let bad = tmp.path().join("bad.json");
    fuzz(
        "vocabulary JSON",
        300,
        proptest::collection::vec(edit.clone(), 1..6),
        |edits| {
            std::fs::write(&bad, mutated(&vtext, &edits)).unwrap();
            Vocab::load(&bad).is_ok()
        },
    );
    // config.json of a run.
    let cfg = serde_json::json!({
        "model": cadenza::model::ModelConfig::preset("tiny", vocab.len() as i64).unwrap(),
        "train": cadenza::train::config::TrainConfig::for_preset("tiny"),
        "vocab_hash": vocab.hash(),
        "dataset": "",
        "preset": "tiny",
    });
    let ctext = serde_json::to_vec_pretty(&cfg).unwrap();
    let _: cadenza::train::config::RunConfig = serde_json::from_slice(&ctext).unwrap();
    fuzz(
        "run config JSON",
        2000,
        proptest::collection::vec(edit, 1..6),
        |edits| {
            let b = mutated(&ctext, &edits);
            match serde_json::from_slice::<cadenza::train::config::RunConfig>(&b) {
                Ok(c) if c.model.validate().is_ok() && c.train.validate().is_ok() => {
                    c.train.lr_at(c.train.steps / 2).is_finite()
                }
                _ => false,
            }
        },
    );
    // Training and tokenizer TOML.
    let ttext = b"preset = \"tiny\"\n[model]\nd_model = 64\nn_heads = 4\n[train]\nlr = 0.001\nseq_len = 64\nsteps = 10\n".to_vec();
    let tok = b"positions_per_quarter = 12\npitch_min = 21\npitch_max = 108\nvelocity_bins = 32\nmax_numerator = 12\ndenominators = [2, 4, 8]\n".to_vec();
    let tchars = b"[]=\"#.,-0123456789abcdefghijklmnopqrstuvwxyz_\n ".to_vec();
    let tedit = (any::<usize>(), proptest::sample::select(tchars));
    fuzz(
        "training TOML",
        2000,
        proptest::collection::vec(tedit.clone(), 1..6),
        |edits| {
            let b = mutated(&ttext, &edits);
            let Ok(text) = std::str::from_utf8(&b) else {
                return false;
            };
            let Ok(f) = toml::from_str::<cadenza::train::config::ConfigFile>(text) else {
                return false;
            };
            let model = cadenza::model::ModelConfig::preset("tiny", 300).unwrap();
            let m = match &f.model {
                Some(t) => cadenza::train::config::merge_table(&model, t)
                    .is_ok_and(|m| m.validate().is_ok()),
                None => true,
            };
            let train = cadenza::train::config::TrainConfig::for_preset("tiny");
            let t = match &f.train {
                Some(t) => cadenza::train::config::merge_table(&train, t)
                    .is_ok_and(|c| c.validate().is_ok()),
                None => true,
            };
            m && t
        },
    );
    fuzz(
        "tokenizer TOML",
        300,
        proptest::collection::vec(tedit, 1..6),
        |edits| {
            let b = mutated(&tok, &edits);
            let Ok(text) = std::str::from_utf8(&b) else {
                return false;
            };
            match toml::from_str::<cadenza::tokenizer::RemiConfig>(text).map(Vocab::new) {
                Ok(Ok(v)) => {
                    let _ = cadenza::tokenizer::decode(&[0, 1, 2, 3, 4, 5], &v);
                    true
                }
                _ => false,
            }
        },
    );
}

#[test]
fn vocab_stats_and_compare_never_write_over_their_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("tok.toml");
    std::fs::write(&cfg, "positions_per_quarter = 12\n").unwrap();
    let r = run_limited(&["vocab", "--config", s(&cfg), "-o", s(&cfg)], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("refusing to overwrite"), "{}", r.stderr);
    assert_eq!(
        std::fs::read_to_string(&cfg).unwrap(),
        "positions_per_quarter = 12\n"
    );
    let mid = tmp.path().join("g.mid");
    std::fs::write(&mid, scale_bytes()).unwrap();
    let r = run_limited(
        &["stats", s(&mid), "--real", s(&mid), "--markdown", s(&mid)],
        20.0,
    );
    assert_eq!(r.code, 1, "{}", r.all());
    assert_eq!(std::fs::read(&mid).unwrap(), scale_bytes());
    let rep = tmp.path().join("r.json");
    std::fs::write(&rep, "{}").unwrap();
    let r = run_limited(&["compare-eval", s(&rep), "--png", s(&rep)], 20.0);
    assert_eq!(r.code, 1, "{}", r.all());
    assert_eq!(std::fs::read_to_string(&rep).unwrap(), "{}");
}

#[test]
fn stats_cuts_pieces_to_bars_filters_short_real_pieces_and_refuses_zero_bars() {
    let tmp = tempfile::tempdir().unwrap();
    let mid = tmp.path().join("g.mid");
    std::fs::write(&mid, scale_bytes()).unwrap();
    let r = run_limited(&["stats", s(&mid), "--real", s(&mid), "--bars", "0"], 20.0);
    assert_eq!(r.code, 2, "{}", r.all());
    assert!(r.stderr.contains("--bars"), "{}", r.stderr);
    let r = run_limited(&["stats", s(&mid), "--real", s(&mid), "--bars", "1"], 20.0);
    assert_eq!(r.code, 0, "{}", r.all());
    assert!(r.stdout.contains("(first 1 bars of each)"), "{}", r.stdout);
    assert!(r.stdout.contains("| pitch_range |"), "{}", r.stdout);
    // Real pieces too short for --min-real-bars leave nothing to compare.
    let r = run_limited(
        &[
            "stats",
            s(&mid),
            "--real",
            s(&mid),
            "--min-real-bars",
            "1000",
        ],
        20.0,
    );
    assert_eq!(r.code, 1, "{}", r.all());
    assert!(r.stderr.contains("one real piece"), "{}", r.stderr);
}

#[test]
fn configuration_inputs_that_are_devices_or_fifos_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mid = tmp.path().join("a.mid");
    std::fs::write(&mid, scale_bytes()).unwrap();
    let fifo = tmp.path().join("vocab.json");
    let have_fifo = mkfifo(&fifo);
    for v in ["/dev/zero", s(&fifo)] {
        if v != "/dev/zero" && !have_fifo {
            continue;
        }
        let r = run_limited(&["encode", s(&mid), "--vocab", v], 10.0);
        assert_eq!(r.code, 1, "{}", r.all());
        assert!(
            r.stderr.contains(v) && r.stderr.contains("only regular files"),
            "{}",
            r.stderr
        );
        let out = tmp.path().join("v.json");
        let r = run_limited(&["vocab", "--config", v, "-o", s(&out)], 10.0);
        assert_eq!(r.code, 1, "{}", r.all());
        assert!(r.stderr.contains("only regular files"), "{}", r.stderr);
    }
}
