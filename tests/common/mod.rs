//! What the hostile-input tests share: running `cadenza` as a child with a deadline,
//! and a small dataset of scales.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cadenza::midi;
use cadenza::tokenizer::{dataset, Vocab};

/// The `cadenza` binary of this build.
pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cadenza"))
}

/// Exit status (-1 for a signal, such as an abort) and stderr of `cadenza ARGS`, with
/// stdin closed and stdout discarded; killed, and the test failed, past `deadline_s`
/// seconds (a command that opened a FIFO, or loops, would hang there).
pub fn run_cadenza(args: &[&str], deadline_s: f64) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let err_p = dir.path().join("err");
    let t0 = Instant::now();
    let mut child = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_p).unwrap())
        .spawn()
        .unwrap();
    let status = loop {
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
    (
        status.code().unwrap_or(-1),
        std::fs::read_to_string(err_p).unwrap_or_default(),
    )
}

/// `keys` one-octave major scales of 32 quarter-length notes, the first from `lowest`,
/// each next one a semitone higher, written as MIDI files into `dir/midi_folder` and
/// tokenized with the default vocabulary into `dir/data` (returned).
pub fn scales_dataset(dir: &Path, midi_folder: &str, keys: u8, lowest: u8) -> PathBuf {
    let mdir = dir.join(midi_folder);
    std::fs::create_dir_all(&mdir).unwrap();
    for k in 0..keys {
        let mut sc = midi::Score::new(480);
        for i in 0..32u64 {
            sc.notes.push(midi::Note {
                start: i * 240,
                duration: 240,
                pitch: lowest + k + [0u8, 2, 4, 5, 7, 9, 11, 12][(i % 8) as usize],
                velocity: 80,
                program: 0,
                channel: 0,
                is_drum: false,
            });
        }
        midi::write_file(&sc, &mdir.join(format!("s{k}.mid"))).unwrap();
    }
    let vocab = Vocab::new(Default::default()).unwrap();
    let files = dataset::collect_midi_files(&[mdir]).unwrap();
    let results = dataset::tokenize_files(&files, &vocab, &|| {});
    let data = dir.join("data");
    dataset::write_dataset(&data, &vocab, &files, results).unwrap();
    data
}
