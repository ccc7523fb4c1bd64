//! Hostile outputs (issue 28): outputs that are devices, FIFOs or sockets,
//! outputs inside the folders a command reads, the run being read, bad input
//! echoed into error lines, and what a stopped `tokenize` leaves behind.
//!
//! Device nodes and FIFOs are made in a temporary folder, never the system's
//! `/dev`. The model folders here are fakes: every refusal comes before a
//! model is loaded, so a command that got past its check fails in another
//! way and the test says which.

mod common;

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

use common::bin;

/// `common::run_cadenza`: a command that opened a FIFO would hang past the deadline.
fn cadenza(args: &[&str], deadline_s: f64) -> (i32, String) {
    common::run_cadenza(args, deadline_s)
}

fn sample_midi() -> Vec<u8> {
    std::fs::read("midi_samples/oneills-jig-6-8.mid").unwrap()
}

/// Special files to write over, in `dir`: a FIFO, a socket and (as root) a
/// character device equal to /dev/null, made with mknod here.
fn special_files(dir: &Path) -> Vec<(PathBuf, &'static str)> {
    let mut out = Vec::new();
    let fifo = dir.join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    out.push((fifo, "FIFO"));
    let sock = dir.join("sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    std::mem::forget(listener);
    out.push((sock, "socket"));
    let null = dir.join("null");
    let made = Command::new("mknod")
        .args([s(&null), "c", "1", "3"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|st| st.success());
    if made {
        out.push((null, "character device"));
    } else {
        println!("not root: no character device made, FIFO and socket only");
    }
    out
}

/// Whether `p` is still the special file it was made as.
fn still_special(p: &Path) -> bool {
    let ft = std::fs::symlink_metadata(p).unwrap().file_type();
    ft.is_fifo() || ft.is_socket() || ft.is_char_device()
}

/// A fake run folder with every file a run has (contents are only markers).
fn fake_run(dir: &Path) -> PathBuf {
    let run = dir.join("run");
    for d in ["checkpoint", "best"] {
        std::fs::create_dir_all(run.join(d)).unwrap();
    }
    for f in [
        "config.json",
        "vocab.json",
        "generation_config.json",
        "metrics.jsonl",
        "checkpoint/model.safetensors",
        "checkpoint/state.json",
        "checkpoint/train_features.safetensors",
        "best/model.safetensors",
    ] {
        std::fs::write(run.join(f), format!("original {f}")).unwrap();
    }
    run
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// A token file of one scale.
fn tokens_file(dir: &Path) -> PathBuf {
    let mid = dir.join("p.mid");
    std::fs::write(&mid, sample_midi()).unwrap();
    let out = Command::new(bin())
        .args(["encode", s(&mid)])
        .output()
        .unwrap();
    assert!(out.status.success());
    let t = dir.join("t.txt");
    std::fs::write(&t, &out.stdout).unwrap();
    t
}

#[test]
fn no_command_writes_over_a_device_a_fifo_or_a_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tokens_file(tmp.path());
    let mid = tmp.path().join("p.mid");
    let run = fake_run(tmp.path());
    let report = tmp.path().join("r.json");
    std::fs::write(&report, "{}").unwrap();
    let (real, gen) = (tmp.path().join("real"), tmp.path().join("gen"));
    for d in [&real, &gen] {
        std::fs::create_dir(d).unwrap();
        std::fs::write(d.join("a.mid"), sample_midi()).unwrap();
    }
    let specials = special_files(&tmp.path().join("specials").tap_mkdir());
    let new = tmp.path().join("new.mid");
    let new = s(&new);
    for (target, what) in &specials {
        let x = s(target);
        let cases: Vec<Vec<&str>> = vec![
            vec!["decode", s(&t), "-o", x],
            vec!["vocab", "-o", x],
            vec!["render", s(&mid), "-o", x],
            vec!["generate", "--model", s(&run), "-o", x],
            vec!["generate", "--model", s(&run), "-o", new, "--wav", x],
            vec!["generate", "--model", s(&run), "-o", new, "--png", x],
            vec!["generate", "--model", s(&run), "-o", new, "--tokens-out", x],
            vec!["eval", "--model", s(&run), "--json", x],
            vec!["eval", "--model", s(&run), "--png", x],
            vec!["continue-eval", "--model", s(&run), "--json", x],
            vec!["stats", s(&gen), "--real", s(&real), "--markdown", x],
            vec!["compare-eval", s(&report), "--png", x],
        ];
        for args in cases {
            let (code, err) = cadenza(&args, 60.0);
            assert_eq!(code, 1, "{args:?}: {err}");
            assert!(
                err.contains(x) && err.contains(what) && err.contains("regular file"),
                "{args:?}: {err}"
            );
            assert!(still_special(target), "{args:?} replaced {x}");
        }
    }
    assert!(!Path::new(new).exists());
    // `-` is not standard output here: refused, no file called "-" made.
    let (code, err) = cadenza(&["decode", s(&t), "-o", "-"], 20.0);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("standard output"), "{err}");
    assert!(!Path::new("-").exists());
}

/// `create_dir` returning the path, for one-line fixtures.
trait TapMkdir {
    fn tap_mkdir(self) -> PathBuf;
}

impl TapMkdir for PathBuf {
    fn tap_mkdir(self) -> PathBuf {
        std::fs::create_dir_all(&self).unwrap();
        self
    }
}

#[test]
fn no_output_replaces_a_file_inside_an_input_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, real) = (
        tmp.path().join("dir").tap_mkdir(),
        tmp.path().join("real").tap_mkdir(),
    );
    let a = dir.join("a.mid");
    let b = real.join("b.mid");
    std::fs::write(&a, sample_midi()).unwrap();
    std::fs::write(&b, sample_midi()).unwrap();
    let run = fake_run(tmp.path());
    let cases: Vec<(Vec<&str>, &Path, &str)> = vec![
        (
            vec!["stats", s(&dir), "--real", s(&real), "--markdown", s(&a)],
            &a,
            "generated",
        ),
        (
            vec!["stats", s(&dir), "--real", s(&real), "--markdown", s(&b)],
            &b,
            "--real",
        ),
        (
            vec![
                "eval",
                "--model",
                s(&run),
                "--data",
                s(&dir),
                "--json",
                s(&a),
            ],
            &a,
            "--data",
        ),
        (
            vec![
                "continue-eval",
                "--model",
                s(&run),
                "--data",
                s(&dir),
                "--json",
                s(&a),
            ],
            &a,
            "--data",
        ),
    ];
    for (args, victim, flag) in cases {
        let (code, err) = cadenza(&args, 60.0);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(
            err.contains("refusing to overwrite an input") && err.contains(flag),
            "{args:?}: {err}"
        );
        assert_eq!(std::fs::read(victim).unwrap(), sample_midi(), "{args:?}");
    }
    // A hard link outside the folder to a file inside it is the same file.
    let link = tmp.path().join("link.md");
    std::fs::hard_link(&a, &link).unwrap();
    let (code, err) = cadenza(
        &["stats", s(&dir), "--real", s(&real), "--markdown", s(&link)],
        60.0,
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("same file as"), "{err}");
    assert_eq!(std::fs::read(&a).unwrap(), sample_midi());
}

#[test]
fn the_run_being_read_is_never_written_over() {
    let tmp = tempfile::tempdir().unwrap();
    let run = fake_run(tmp.path());
    let before = snapshot(&run);
    let f = |p: &str| s(&run).to_string() + "/" + p;
    let weights = f("checkpoint/model.safetensors");
    let features = f("checkpoint/train_features.safetensors");
    let (config, metrics, state, best) = (
        f("config.json"),
        f("metrics.jsonl"),
        f("checkpoint/state.json"),
        f("best/model.safetensors"),
    );
    let elsewhere = tmp.path().join("piece.mid");
    let checkpoint = f("checkpoint");
    let cases: Vec<Vec<&str>> = vec![
        vec!["generate", "--model", s(&run), "-o", &weights],
        vec![
            "generate",
            "--model",
            s(&run),
            "-o",
            s(&elsewhere),
            "--tokens-out",
            &features,
        ],
        vec![
            "generate",
            "--model",
            s(&run),
            "-o",
            s(&elsewhere),
            "--wav",
            &best,
        ],
        // Given its checkpoint folder, the run around it is read too.
        vec!["generate", "--model", &checkpoint, "-o", &metrics],
        vec!["eval", "--model", s(&run), "--json", &config],
        vec!["eval", "--model", s(&run), "--json", &metrics],
        vec!["eval", "--model", s(&run), "--png", &weights],
        vec!["continue-eval", "--model", s(&run), "--json", &state],
    ];
    for args in cases {
        let (code, err) = cadenza(&args, 60.0);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(
            err.contains("refusing to overwrite an input") && err.contains("--model"),
            "{args:?}: {err}"
        );
    }
    assert_eq!(snapshot(&run), before);
    assert!(!elsewhere.exists());
}

#[test]
fn decode_never_writes_over_its_vocabulary() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tokens_file(tmp.path());
    let v = tmp.path().join("v.json");
    let out = Command::new(bin())
        .args(["vocab", "-o", s(&v)])
        .output()
        .unwrap();
    assert!(out.status.success());
    let before = std::fs::read(&v).unwrap();
    let (code, err) = cadenza(&["decode", "--vocab", s(&v), s(&t), "-o", s(&v)], 20.0);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("the input --vocab"), "{err}");
    assert_eq!(std::fs::read(&v).unwrap(), before);
    // vocab -o onto its own --config.
    let cfg = tmp.path().join("c.toml");
    std::fs::write(&cfg, "").unwrap();
    let (code, err) = cadenza(&["vocab", "--config", s(&cfg), "-o", s(&cfg)], 20.0);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("the input --config"), "{err}");
}

#[test]
fn error_lines_quote_a_bounded_escaped_excerpt() {
    let tmp = tempfile::tempdir().unwrap();
    // One bad token of 20 MB.
    let t = tmp.path().join("t.txt");
    let mut text = String::from("Bar ");
    text.push_str(&"X".repeat(20 << 20));
    std::fs::write(&t, &text).unwrap();
    let (code, err) = cadenza(&["decode", s(&t), "-o", s(&tmp.path().join("o.mid"))], 60.0);
    assert_eq!(code, 1, "{}", &err[..err.len().min(2000)]);
    assert!(err.len() < 2000, "{} bytes of stderr", err.len());
    assert!(
        err.contains("unknown token") && err.contains(&format!("({} bytes)", 20 << 20)),
        "{err}"
    );
    // A newline in a file name found in a folder cannot start a log line.
    let dir = tmp.path().join("in").tap_mkdir();
    std::fs::write(dir.join("good.mid"), sample_midi()).unwrap();
    std::fs::write(dir.join("x\nERROR forged line.mid"), b"not midi").unwrap();
    let out = tmp.path().join("ds");
    let (code, err) = cadenza(&["tokenize", s(&dir), "-o", s(&out)], 60.0);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("x\\nERROR forged line.mid"), "{err}");
    assert!(err.lines().all(|l| !l.starts_with("ERROR forged")), "{err}");
}

/// The temporary files in `dir` (`.NAME.<pid>.tmp`).
fn temps(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|r| {
            r.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('.') && n.ends_with(".tmp"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_stopped_tokenize_leaves_no_temporary_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("in").tap_mkdir();
    for i in 0..3000 {
        std::fs::write(dir.join(format!("a{i}.mid")), sample_midi()).unwrap();
    }
    for sig in ["TERM", "INT"] {
        let out = tmp.path().join(format!("ds-{sig}"));
        let mut child = Command::new(bin())
            .args(["tokenize", s(&dir), "-o", s(&out), "-j", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Wait for its temporary tokens.bin, then stop it.
        let t0 = Instant::now();
        while temps(&out).is_empty() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no temporary file appeared"
            );
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let stopped = Command::new("kill")
            .args([&format!("-{sig}"), &child.id().to_string()])
            .status()
            .unwrap();
        assert!(stopped.success());
        let st = child.wait().unwrap();
        if st.success() {
            println!("SIG{sig}: tokenize finished before the signal; nothing to check");
            continue;
        }
        assert!(temps(&out).is_empty(), "SIG{sig} left {:?}", temps(&out));
    }
    // Stale ones of a dead process are reclaimed by the next tokenize.
    let out = tmp.path().join("ds-stale").tap_mkdir();
    let mut c = Command::new("true").spawn().unwrap();
    let dead = c.id();
    c.wait().unwrap();
    let stale = out.join(format!(".tokens.bin.{dead}.tmp"));
    std::fs::write(&stale, b"half").unwrap();
    let one = tmp.path().join("one").tap_mkdir();
    std::fs::write(one.join("a.mid"), sample_midi()).unwrap();
    let (code, err) = cadenza(&["tokenize", s(&one), "-o", s(&out)], 60.0);
    assert_eq!(code, 0, "{err}");
    assert!(
        !stale.exists() && temps(&out).is_empty(),
        "{:?}",
        temps(&out)
    );
    assert!(out.join("manifest.json").is_file());
}
