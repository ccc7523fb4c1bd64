//! `cadenza stats` reports the form measures: an AABB piece returns its
//! strain (strain return 1), a through-composed one does not, the JSON holds
//! them per piece and on average, `--form-png` draws a picture per generated
//! piece, and a bad `--strain-bars` is refused.

mod common;

use std::path::Path;

use cadenza::midi;

/// Writes a 4/4 piece of 8-note bars at 480 ticks a quarter: bar k plays the
/// motif `strains[k / 8] * 8 + k % 8` (every motif its own pitches).
fn write_piece(path: &Path, strains: &[u8]) {
    let mut s = midi::Score::new(480);
    for (k, &strain) in strains.iter().flat_map(|x| [x; 8]).enumerate() {
        let motif = strain as u64 * 8 + (k % 8) as u64;
        for i in 0..8u64 {
            s.notes.push(midi::Note {
                start: k as u64 * 1920 + i * 240,
                duration: 240,
                pitch: (40 + (motif * 3 + i * 5) % 60) as u8,
                velocity: 80,
                program: 0,
                channel: 0,
                is_drum: false,
            });
        }
    }
    s.sort();
    midi::write_file(&s, path).unwrap();
}

#[test]
fn stats_reports_the_strain_return_of_an_aabb_piece() {
    let dir = tempfile::tempdir().unwrap();
    let gen = dir.path().join("aabb.mid");
    write_piece(&gen, &[0, 0, 1, 1]);
    let real = dir.path().join("real");
    std::fs::create_dir_all(&real).unwrap();
    write_piece(&real.join("abcd.mid"), &[2, 3, 4, 5]);
    let json = dir.path().join("stats.json");
    let pngs = dir.path().join("form");
    let (rc, err) = common::run_cadenza(
        &[
            "stats",
            gen.to_str().unwrap(),
            "--real",
            real.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
            "--form-png",
            pngs.to_str().unwrap(),
        ],
        120.0,
    );
    assert_eq!(rc, 0, "{err}");
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(j["strain_bars"], 8);
    let g = &j["generated"];
    let strain = g["summary"]["strain_return"].as_f64().unwrap();
    assert!(
        (strain - 1.0).abs() < 1e-9,
        "generated strain return {strain}"
    );
    assert_eq!(g["summary"]["strain_share"].as_f64(), Some(1.0));
    let piece = &g["pieces"][0];
    assert_eq!(piece["bars"], 32);
    assert!(piece["source"].as_str().unwrap().ends_with("aabb.mid"));
    // L_8: A-A and B-B pairs (16 of 24) are copies, the second A against
    // the first B is not.
    let l8 = piece["similarity_curve"][7].as_f64().unwrap();
    assert!((l8 - 2.0 / 3.0).abs() < 1e-9, "L_8 {l8}");
    assert!(piece["similarity_curve"][31].is_null());
    // W = 16: bars 17..32 are B, nothing 16 bars back copies them, except
    // bars 25..32 (copies of 17..24 are only 8 back): no recall.
    assert_eq!(piece["section_recall"]["16"].as_f64(), Some(0.0));
    assert!(piece["section_recall"]["32"].is_null());
    let r = &j["real"]["summary"];
    assert_eq!(r["strain_return"].as_f64(), Some(0.0));
    assert_eq!(r["pieces"], 1);
    assert!(j["statistics"].as_array().unwrap().len() > 3);
    // One picture per generated piece.
    let png = pngs.join("aabb.png");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");

    // Strain return over 4 bars: bars 5..8 against 1..4 are other motifs.
    let (rc, err) = common::run_cadenza(
        &[
            "stats",
            gen.to_str().unwrap(),
            "--real",
            real.to_str().unwrap(),
            "--strain-bars",
            "4",
            "--json",
            json.to_str().unwrap(),
        ],
        120.0,
    );
    assert_eq!(rc, 0, "{err}");
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(j["strain_bars"], 4);
    assert_eq!(
        j["generated"]["summary"]["strain_return"].as_f64(),
        Some(0.0)
    );
}

#[test]
fn bad_strain_bars_and_outputs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let gen = dir.path().join("aabb.mid");
    write_piece(&gen, &[0, 0]);
    let g = gen.to_str().unwrap();
    for bad in ["0", "5000", "-3", "eight"] {
        let flag = format!("--strain-bars={bad}");
        let (rc, err) = common::run_cadenza(&["stats", g, "--real", g, &flag], 60.0);
        assert_ne!(rc, 0, "--strain-bars {bad} was accepted");
        assert!(err.contains("--strain-bars"), "{bad}: {err}");
    }
    // The JSON may not replace an input.
    let before = std::fs::read(&gen).unwrap();
    let (rc, err) = common::run_cadenza(&["stats", g, "--real", g, "--json", g], 60.0);
    assert_ne!(rc, 0);
    assert!(err.contains("--json"), "{err}");
    assert_eq!(std::fs::read(&gen).unwrap(), before);
}
