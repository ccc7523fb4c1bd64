//! Data-parallel training over MPI on localhost (`cargo test --features distributed --test
//! distributed`; `make distributed-test` installs Open MPI first). Each test launches
//! `mpirun -np 2` on the tiny preset and holds the run to what one process computes, or to
//! the failure behaviour of src/train/distributed.rs.

#![cfg(feature = "distributed")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cadenza::train::{read_metrics, Metrics};

/// The flags of every run here; `--batch` is the global batch.
fn tiny_flags(run: &Path, data: &Path, steps: u64, batch: u64) -> Vec<String> {
    [
        "train",
        "-o",
        run.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--preset",
        "tiny",
        "--seq-len",
        "32",
        "--seed",
        "3",
        "--device",
        "cpu",
        "--threads",
        "1",
        // f32 everywhere: `auto` is bf16 on a CPU with AMX or AVX512-BF16, where the
        // native kernels of 4-row and 8-row products round differently, beyond the
        // f32 tolerances these comparisons are measured in.
        "--precision",
        "f32",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        "--steps".into(),
        steps.to_string(),
        "--batch".into(),
        batch.to_string(),
    ])
    .collect()
}

/// `mpirun -np N` of localhost as root in a container, with one application context per
/// entry of `apps` (each its own arguments to cadenza) when there are several.
fn mpirun(apps: &[(usize, Vec<String>)]) -> Command {
    let mut c = Command::new("mpirun");
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .arg("--oversubscribe");
    for (i, (n, args)) in apps.iter().enumerate() {
        if i > 0 {
            c.arg(":");
        }
        c.arg("-np")
            .arg(n.to_string())
            .arg(common::bin())
            .args(args);
    }
    c.stdin(Stdio::null());
    c
}

/// Runs `cmd` to its end (at most `deadline_s`): exit code and stderr.
fn finish(mut cmd: Command, deadline_s: f64) -> (i32, String, f64) {
    let dir = tempfile::tempdir().unwrap();
    let err = dir.path().join("err");
    let child = cmd
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("mpirun: is Open MPI installed? (make distributed-test installs it)");
    let (code, secs) = wait(child, deadline_s);
    (code, std::fs::read_to_string(err).unwrap_or_default(), secs)
}

fn wait(mut child: Child, deadline_s: f64) -> (i32, f64) {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return (st.code().unwrap_or(-1), t0.elapsed().as_secs_f64());
        }
        if t0.elapsed().as_secs_f64() > deadline_s {
            child.kill().ok();
            child.wait().ok();
            panic!("mpirun still ran after {deadline_s} s: killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn single(args: &[String]) -> (i32, String) {
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    common::run_cadenza(&a, 300.0)
}

fn losses(run: &Path) -> Vec<(u64, f64, f64)> {
    read_metrics(run)
        .unwrap()
        .iter()
        .map(|m: &Metrics| (m.step, m.train_loss.unwrap(), m.grad_norm.unwrap()))
        .collect()
}

fn assert_same_losses(a: &[(u64, f64, f64)], b: &[(u64, f64, f64)]) {
    assert_eq!(a.len(), b.len(), "{a:?}\n{b:?}");
    let rel = |x: f64, y: f64| (x - y).abs() / x.abs().max(1e-9);
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.0, y.0);
        // Step 1 is the same windows and weights, only the order of float sums differs.
        // Later steps amplify that rounding: AdamW's first updates are about lr * sign(g),
        // so a gradient element near 0 may move the other way (measured over 20 steps of
        // this run: losses within 1e-4, gradient norms within 2e-3, relative).
        let (loss_tol, norm_tol) = if x.0 == 1 { (1e-5, 1e-4) } else { (1e-3, 2e-2) };
        assert!(
            rel(x.1, y.1) <= loss_tol,
            "step {}: loss {} against {}",
            x.0,
            x.1,
            y.1
        );
        assert!(
            rel(x.2, y.2) <= norm_tol,
            "step {}: gradient norm {} against {}",
            x.0,
            x.2,
            y.2
        );
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    data: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let data = common::scales_dataset(&root, "scales", 6, 48);
    Fixture {
        _dir: dir,
        root,
        data,
    }
}

#[test]
fn two_ranks_of_batch_4_reproduce_one_process_of_batch_8_and_resume_on_one() {
    let f = fixture();
    let one = f.root.join("one");
    let (code, err) = single(&tiny_flags(&one, &f.data, 20, 8));
    assert_eq!(code, 0, "{err}");
    let two = f.root.join("two");
    let (code, err, _) = finish(mpirun(&[(2, tiny_flags(&two, &f.data, 20, 8))]), 300.0);
    assert_eq!(code, 0, "{err}");
    let (a, b) = (losses(&one), losses(&two));
    assert_eq!(a.len(), 20);
    assert_same_losses(&a, &b);
    // every step of two ranks spent time communicating; rank 0 alone wrote
    assert!(read_metrics(&two)
        .unwrap()
        .iter()
        .all(|m| m.comm_s.is_some()));
    assert!(read_metrics(&one)
        .unwrap()
        .iter()
        .all(|m| m.comm_s.is_none()));

    // stopped at step 10 on two ranks, resumed on one: the same last 10 steps
    let half = f.root.join("half");
    let mut flags = tiny_flags(&half, &f.data, 20, 8);
    flags.extend(["--stop-after".into(), "10".into()]);
    let (code, err, _) = finish(mpirun(&[(2, flags)]), 300.0);
    assert_eq!(code, 0, "{err}");
    let resume: Vec<String> = [
        "train",
        "-o",
        half.to_str().unwrap(),
        "--resume",
        "--threads",
        "1",
        "--device",
        "cpu",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (code, err) = single(&resume);
    assert_eq!(code, 0, "{err}");
    assert_same_losses(&a, &losses(&half));
}

#[test]
fn ranks_that_disagree_or_cannot_share_the_batch_are_refused() {
    let f = fixture();
    let run = f.root.join("run");
    let mut other = tiny_flags(&run, &f.data, 20, 8);
    let at = other.iter().position(|a| a == "--seq-len").unwrap();
    other[at + 1] = "16".into();
    let (code, err, _) = finish(
        mpirun(&[(1, tiny_flags(&run, &f.data, 20, 8)), (1, other)]),
        300.0,
    );
    assert_ne!(code, 0);
    assert!(
        err.contains("rank 1 has another configuration than rank 0"),
        "{err}"
    );
    assert!(!run.join("checkpoint").exists());

    let run = f.root.join("odd");
    let (code, err, _) = finish(mpirun(&[(2, tiny_flags(&run, &f.data, 20, 3))]), 300.0);
    assert_ne!(code, 0);
    assert!(
        err.contains("--batch 3 cannot be shared by 2 ranks"),
        "{err}"
    );
}

/// The pid of rank `rank` among the processes `mpirun` (pid `launcher`) started.
fn rank_pid(launcher: u32, rank: usize) -> Option<u32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    let mut todo = vec![launcher];
    while let Some(p) = todo.pop() {
        for task in std::fs::read_dir(format!("/proc/{p}/task")).ok()?.flatten() {
            let kids = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for k in kids
                .split_whitespace()
                .filter_map(|k| k.parse::<u32>().ok())
            {
                let env = std::fs::read(format!("/proc/{k}/environ")).unwrap_or_default();
                if env.split(|&b| b == 0).any(|v| v == want.as_bytes()) {
                    return Some(k);
                }
                todo.push(k);
            }
        }
    }
    None
}

/// Rank 0 validates, plots and saves between two collectives (in a debug build on a
/// loaded machine, seconds): the timeout of the failure tests.
const TIMEOUT_S: u64 = 20;

/// Starts a long 2-rank run with `--rank-timeout TIMEOUT_S`, waits for its first checkpoint, does
/// `signal` to rank 1, and returns the job's exit code, stderr and seconds from the
/// signal to the end; then checks that the checkpoint resumes.
fn signal_rank_1(signal: &str) -> (i32, String, f64) {
    let f = fixture();
    let run = f.root.join("run");
    let mut flags = tiny_flags(&run, &f.data, 100_000, 8);
    flags.extend(["--rank-timeout".into(), TIMEOUT_S.to_string()]);
    let dir = tempfile::tempdir().unwrap();
    let err_p = dir.path().join("err");
    let child = mpirun(&[(2, flags)])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_p).unwrap())
        .spawn()
        .expect("mpirun");
    let t0 = Instant::now();
    // the tiny preset checkpoints every 20 steps
    while !run.join("checkpoint").is_dir() {
        assert!(t0.elapsed().as_secs() < 240, "no checkpoint after 240 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid = rank_pid(child.id(), 1).expect("rank 1's process");
    let st = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let (code, secs) = wait(child, 120.0);
    eprintln!("kill {signal} to rank 1: the job ended {secs:.1} s later (exit code {code})");
    let err = std::fs::read_to_string(err_p).unwrap_or_default();
    // the last checkpoint stays valid: one more step from it on one process
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("checkpoint/state.json")).unwrap())
            .unwrap();
    let step = state["step"].as_u64().unwrap();
    let (c, e) = single(
        &[
            "train",
            "-o",
            run.to_str().unwrap(),
            "--resume",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--stop-after",
            &(step + 1).to_string(),
        ]
        .map(String::from),
    );
    assert_eq!(c, 0, "resume after the failure: {e}");
    (code, err, secs)
}

#[test]
fn a_hung_rank_ends_the_job_after_the_rank_timeout() {
    let (code, err, secs) = signal_rank_1("-STOP");
    assert_ne!(code, 0);
    let said = format!("no answer from the other ranks for {TIMEOUT_S} s");
    assert!(err.contains(&said), "{err}");
    // the timeout, the watchdog's 1/4 s tick, mpirun's clean-up
    assert!(secs >= TIMEOUT_S as f64, "the job ended after {secs:.1} s");
    assert!(
        secs < TIMEOUT_S as f64 + 15.0,
        "the job took {secs:.1} s to end"
    );
}

#[test]
fn a_killed_rank_ends_the_job() {
    let (code, err, secs) = signal_rank_1("-KILL");
    assert_ne!(code, 0, "{err}");
    // mpirun ends the job once a rank is gone, long before any timeout
    assert!(secs < 10.0, "the job took {secs:.1} s to end:\n{err}");
}
