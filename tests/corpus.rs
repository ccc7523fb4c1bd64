//! Round trips over every file of the shared corpus (`../shared/corpus`, or
//! `$CADENZA_CORPUS`). Ignored by default because a user's clone has no
//! corpus; `.ci/run` runs them with `--ignored`.

use std::path::PathBuf;

use cadenza::tokenizer::{dataset, fidelity, RemiConfig, Vocab};
use rayon::prelude::*;

fn corpus() -> PathBuf {
    let p = std::env::var_os("CADENZA_CORPUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/corpus"));
    assert!(
        p.is_dir(),
        "corpus folder {} not found (set CADENZA_CORPUS)",
        p.display()
    );
    p
}

#[test]
#[ignore]
fn every_corpus_file_round_trips_within_bounds() {
    let vocab = Vocab::new(RemiConfig::default()).unwrap();
    let files = dataset::collect_midi_files(&[corpus()]).unwrap();
    assert!(files.len() > 1000, "only {} files", files.len());
    let results: Vec<(String, Result<fidelity::Fidelity, String>)> = files
        .par_iter()
        .map(|(p, rel)| {
            let r = cadenza::midi::read_file(p)
                .map(|(s, _)| fidelity::measure(&s, &vocab))
                .map_err(|e| e.to_string());
            (rel.clone(), r)
        })
        .collect();
    let mut total = fidelity::Fidelity::default();
    let mut bad = Vec::new();
    let mut unreadable = Vec::new();
    for (name, r) in &results {
        match r {
            Err(e) => unreadable.push(format!("{name}: {e}")),
            Ok(f) => {
                total.notes += f.notes;
                total.dropped_out_of_range += f.dropped_out_of_range;
                total.clipped += f.clipped;
                total.unsupported_time_signatures += f.unsupported_time_signatures;
                total.max_onset_error_steps =
                    total.max_onset_error_steps.max(f.max_onset_error_steps);
                total.max_velocity_error = total.max_velocity_error.max(f.max_velocity_error);
                total.max_tempo_error = total.max_tempo_error.max(f.max_tempo_error);
                if !f.is_perfect() {
                    bad.push(format!("{name}: {f:?}"));
                }
            }
        }
    }
    println!(
        "{} files, {} notes; dropped out of range {}, clipped {}, unsupported time signatures {}; \
         max onset error {:.3} steps, max velocity error {}, max tempo error {:.4}",
        results.len(),
        total.notes,
        total.dropped_out_of_range,
        total.clipped,
        total.unsupported_time_signatures,
        total.max_onset_error_steps,
        total.max_velocity_error,
        total.max_tempo_error
    );
    assert!(unreadable.is_empty(), "unreadable files: {unreadable:#?}");
    assert!(
        bad.is_empty(),
        "{} files outside the bounds, first: {:#?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
}
