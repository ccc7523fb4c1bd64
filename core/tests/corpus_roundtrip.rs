//! Notes of the shared corpus through the whole round trip: read the file,
//! encode, decode, write the MIDI file `cadenza decode` would write, read it
//! back ([`fidelity::measure`]). Prints the note totals of the corpus and of
//! each top folder, every file that lost a note with the reasons, and the
//! worst files; asserts that at least 99.95% of the notes come back on the
//! whole corpus and on the multitrack folders (`games/`, `classical/`), and
//! that the only notes lost are those outside the pitch range (none between
//! the tokens and the MIDI file).
//!
//! Ignored by default because a user's clone has no corpus. The corpus is
//! `$CADENZA_CORPUS`, else `../shared/corpus` beside the repository. Run it
//! with `cargo test -p cadenza-core --release --test corpus_roundtrip --
//! --ignored --nocapture`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use cadenza_core::midi;
use cadenza_core::tokenizer::fidelity::{self, Fidelity};
use cadenza_core::tokenizer::{dataset, RemiConfig, Vocab};
use rayon::prelude::*;

/// The least share of notes that must come back, in percent.
const BOUND_PERCENT: f64 = 99.95;

fn corpus() -> PathBuf {
    let p = std::env::var_os("CADENZA_CORPUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/corpus"))
        });
    assert!(
        p.is_dir(),
        "corpus folder {} not found (set CADENZA_CORPUS)",
        p.display()
    );
    p
}

/// Note counts of a set of files.
#[derive(Default)]
struct Totals {
    files: usize,
    notes: usize,
    back: usize,
    out_of_range: usize,
    changed: usize,
    missing: usize,
    extra: usize,
}

impl Totals {
    fn add(&mut self, f: &Fidelity) {
        self.files += 1;
        self.notes += f.notes;
        self.back += f.notes_back();
        self.out_of_range += f.dropped_out_of_range;
        self.changed += f.midi.changed;
        self.missing += f.midi.missing;
        self.extra += f.midi.extra;
    }

    fn percent(&self) -> f64 {
        percent(self.back, self.notes)
    }

    fn line(&self, name: &str) -> String {
        format!(
            "{name}: {} files, {} notes, {} back ({:.4}%); lost: {} out of the pitch range, \
             {} with another duration or velocity, {} missing; {} extra",
            self.files,
            self.notes,
            self.back,
            self.percent(),
            self.out_of_range,
            self.changed,
            self.missing,
            self.extra
        )
    }
}

fn percent(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        100.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

#[test]
#[ignore]
fn corpus_notes_come_back_through_tokens_and_midi_files() {
    let root = corpus();
    let vocab = Vocab::new(RemiConfig::default()).unwrap();
    let files = dataset::collect_midi_files(std::slice::from_ref(&root)).unwrap();
    assert!(files.len() > 1000, "only {} files", files.len());
    let results: Vec<(String, Result<Fidelity, String>)> = files
        .par_iter()
        .map(|(p, rel)| {
            let r = midi::read_file(p)
                .map(|(s, _)| fidelity::measure(&s, &vocab))
                .map_err(|e| e.to_string());
            // Names relative to the corpus folder, so that the first
            // component is the top folder (games, classical, folk).
            let name = p
                .strip_prefix(&root)
                .map(|r| r.to_string_lossy().into_owned())
                .unwrap_or_else(|_| rel.clone());
            (name, r)
        })
        .collect();

    let mut all = Totals::default();
    let mut folders: BTreeMap<String, Totals> = BTreeMap::new();
    let mut unreadable = Vec::new();
    let mut unwritable = Vec::new();
    let mut unaccounted = Vec::new();
    let mut lossy: Vec<(f64, String, &Fidelity)> = Vec::new();
    for (name, r) in &results {
        let f = match r {
            Ok(f) => f,
            Err(e) => {
                unreadable.push(format!("{name}: {e}"));
                continue;
            }
        };
        let folder = name.split(['/', '\\']).next().unwrap_or(name).to_string();
        all.add(f);
        folders.entry(folder).or_default().add(f);
        if f.midi.unwritable {
            unwritable.push(name.clone());
        }
        // Every note is back or lost for a reason that is counted.
        if f.notes != f.notes_back() + f.dropped_out_of_range + f.midi.lost() {
            unaccounted.push(format!("{name}: {f:?}"));
        }
        if f.notes_back() < f.notes || f.midi.extra > 0 {
            lossy.push((percent(f.notes_back(), f.notes), name.clone(), f));
        }
    }

    println!("{}", all.line("corpus"));
    for (folder, t) in &folders {
        println!("{}", t.line(&format!("{folder}/")));
    }
    let mut multitrack = Totals::default();
    for folder in ["games", "classical"] {
        if let Some(t) = folders.get(folder) {
            multitrack.files += t.files;
            multitrack.notes += t.notes;
            multitrack.back += t.back;
            multitrack.out_of_range += t.out_of_range;
            multitrack.changed += t.changed;
            multitrack.missing += t.missing;
            multitrack.extra += t.extra;
        }
    }
    println!("{}", multitrack.line("multitrack (games/ and classical/)"));
    lossy.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    println!("{} files lose notes (worst first):", lossy.len());
    for (pct, name, f) in &lossy {
        println!(
            "  {name}: {} of {} notes back ({pct:.3}%); {} out of the pitch range, {} with \
             another duration or velocity, {} missing, {} extra",
            f.notes_back(),
            f.notes,
            f.dropped_out_of_range,
            f.midi.changed,
            f.midi.missing,
            f.midi.extra
        );
    }

    assert!(unreadable.is_empty(), "unreadable files: {unreadable:#?}");
    assert!(
        unwritable.is_empty(),
        "decoded scores that cannot be written and read back: {unwritable:#?}"
    );
    assert!(
        unaccounted.is_empty(),
        "notes neither back nor counted as lost: {unaccounted:#?}"
    );
    // The bound: a note inside the pitch range always comes back exactly
    // (the writer gives overlapping notes of one pitch voices of their own),
    // so out-of-range notes are the only loss.
    let through_midi: Vec<String> = lossy
        .iter()
        .filter(|(_, _, f)| f.midi.lost() > 0 || f.midi.extra > 0)
        .map(|(_, name, f)| format!("{name}: {:?}", f.midi))
        .collect();
    assert!(
        through_midi.is_empty(),
        "{} files lose notes between the tokens and a MIDI file: {:#?}",
        through_midi.len(),
        &through_midi[..through_midi.len().min(10)]
    );
    let folder = |name: &str| {
        folders
            .get(name)
            .unwrap_or_else(|| panic!("the corpus has no {name}/ folder"))
    };
    for (name, t) in [
        ("the corpus", &all),
        ("games/", folder("games")),
        ("classical/", folder("classical")),
        ("the multitrack files", &multitrack),
    ] {
        assert!(
            t.percent() >= BOUND_PERCENT,
            "{name}: only {:.4}% of the notes come back, under {BOUND_PERCENT}%",
            t.percent()
        );
    }
}
