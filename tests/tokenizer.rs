//! Tokenizer round trips on hand-made edge cases, grammar checks, and
//! property tests (random scores, random valid token sequences, random bytes).

use cadenza::midi::{self, Note, Score, TempoChange, TimeSignature};
use cadenza::tokenizer::{
    decode, encode, encode_quantized, fidelity, quantize, validate, Grammar, RemiConfig, Token,
    TokenType, Vocab, EOS_ID,
};
use midly::num::{u15, u24, u28, u4, u7};
use midly::{Format, Header, MetaMessage, MidiMessage, Smf, Timing, TrackEvent, TrackEventKind};
use proptest::prelude::*;

fn vocab() -> Vocab {
    Vocab::new(RemiConfig::default()).unwrap()
}

/// The config with the two vocabulary options set.
fn options_config(program_changes: bool, velocities: bool) -> RemiConfig {
    RemiConfig {
        program_changes,
        velocities,
        ..RemiConfig::default()
    }
}

/// The vocabularies of the four option combinations, index
/// `2 * program_changes + velocities`; index 1 is the default.
fn option_vocabs() -> &'static [Vocab; 4] {
    static V: std::sync::OnceLock<[Vocab; 4]> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        [(false, false), (false, true), (true, false), (true, true)]
            .map(|(pc, vel)| Vocab::new(options_config(pc, vel)).unwrap())
    })
}

fn ev(delta: u32, kind: TrackEventKind<'static>) -> TrackEvent<'static> {
    TrackEvent {
        delta: u28::new(delta),
        kind,
    }
}
fn on(delta: u32, ch: u8, key: u8, vel: u8) -> TrackEvent<'static> {
    ev(
        delta,
        TrackEventKind::Midi {
            channel: u4::new(ch),
            message: MidiMessage::NoteOn {
                key: u7::new(key),
                vel: u7::new(vel),
            },
        },
    )
}
fn off(delta: u32, ch: u8, key: u8) -> TrackEvent<'static> {
    ev(
        delta,
        TrackEventKind::Midi {
            channel: u4::new(ch),
            message: MidiMessage::NoteOff {
                key: u7::new(key),
                vel: u7::new(0),
            },
        },
    )
}
fn program(delta: u32, ch: u8, p: u8) -> TrackEvent<'static> {
    ev(
        delta,
        TrackEventKind::Midi {
            channel: u4::new(ch),
            message: MidiMessage::ProgramChange {
                program: u7::new(p),
            },
        },
    )
}
fn tempo(delta: u32, bpm: f64) -> TrackEvent<'static> {
    ev(
        delta,
        TrackEventKind::Meta(MetaMessage::Tempo(u24::new((60e6 / bpm) as u32))),
    )
}
fn timesig(delta: u32, num: u8, den_pow: u8) -> TrackEvent<'static> {
    ev(
        delta,
        TrackEventKind::Meta(MetaMessage::TimeSignature(num, den_pow, 24, 8)),
    )
}
fn end() -> TrackEvent<'static> {
    ev(0, TrackEventKind::Meta(MetaMessage::EndOfTrack))
}
fn smf_bytes(format: Format, timing: Timing, tracks: Vec<Vec<TrackEvent<'static>>>) -> Vec<u8> {
    let smf = Smf {
        header: Header::new(format, timing),
        tracks,
    };
    let mut out = Vec::new();
    smf.write_std(&mut out).unwrap();
    out
}
fn metrical(tpq: u16) -> Timing {
    Timing::Metrical(u15::new(tpq))
}

fn assert_round_trip(score: &Score) -> fidelity::Fidelity {
    let v = vocab();
    let f = fidelity::measure(score, &v);
    assert!(f.is_perfect(), "{f:?}");
    let (ids, _) = encode(score, &v);
    validate(&ids, &v).unwrap();
    f
}

#[test]
fn empty_file_is_an_empty_score() {
    let bytes = smf_bytes(
        Format::Parallel,
        metrical(480),
        vec![vec![tempo(0, 100.0), end()]],
    );
    let (score, report) = midi::parse(&bytes).unwrap();
    assert!(score.notes.is_empty());
    assert_eq!(report.truncated_tracks, 0);
    let (ids, _) = encode(&score, &vocab());
    assert!(ids.is_empty());
}

#[test]
fn zero_length_overlapping_and_unclosed_notes() {
    let t = vec![
        on(0, 0, 60, 100),
        off(0, 0, 60), // zero length
        on(0, 0, 62, 90),
        on(240, 0, 62, 50), // same pitch again while sounding
        off(240, 0, 62),    // closes the first (FIFO)
        off(240, 0, 62),    // closes the second
        on(0, 0, 64, 70),   // never closed
        end(),
    ];
    let bytes = smf_bytes(Format::SingleTrack, metrical(480), vec![t]);
    let (score, report) = midi::parse(&bytes).unwrap();
    assert_eq!(report.unclosed_notes, 1);
    let n62: Vec<_> = score.notes.iter().filter(|n| n.pitch == 62).collect();
    assert_eq!(
        (n62[0].start, n62[0].duration, n62[0].velocity),
        (0, 480, 90)
    );
    assert_eq!(
        (n62[1].start, n62[1].duration, n62[1].velocity),
        (240, 480, 50)
    );
    let zero = score.notes.iter().find(|n| n.pitch == 60).unwrap();
    assert_eq!(zero.duration, 0);
    let f = assert_round_trip(&score);
    assert_eq!(f.lengthened, 2, "the zero-length and the unclosed note");
}

#[test]
fn running_status_and_note_on_velocity_zero() {
    // Hand-written bytes: one track, note on 60, then running-status data bytes.
    let mut trk = vec![0x00, 0x90, 60, 100, 0x60, 60, 0, 0x00, 64, 80, 0x60, 64, 0];
    trk.extend_from_slice(&[0x00, 0xff, 0x2f, 0x00]);
    let mut bytes = b"MThd\0\0\0\x06\0\0\0\x01\x01\xe0MTrk".to_vec();
    bytes.extend_from_slice(&(trk.len() as u32).to_be_bytes());
    bytes.extend_from_slice(&trk);
    let (score, report) = midi::parse(&bytes).unwrap();
    assert_eq!(report, Default::default());
    let got: Vec<_> = score
        .notes
        .iter()
        .map(|n| (n.start, n.duration, n.pitch))
        .collect();
    assert_eq!(got, vec![(0, 96, 60), (96, 96, 64)]);
}

#[test]
fn tempo_changes_time_signatures_programs_and_drums() {
    let meta = vec![
        timesig(0, 3, 2),
        tempo(0, 90.0),
        tempo(1440, 132.5),
        timesig(0, 6, 3),
        timesig(1440 * 2, 4, 1), // 4/2
        tempo(960, 61.0),
        end(),
    ];
    let mut piano = vec![program(0, 0, 0)];
    let mut drums = vec![];
    for i in 0..40u32 {
        piano.push(on(0, 0, 48 + (i % 24) as u8, 30 + i as u8));
        piano.push(off(240, 0, 48 + (i % 24) as u8));
        drums.push(on(0, 9, 36 + (i % 10) as u8, 100));
        drums.push(off(120, 9, 36 + (i % 10) as u8));
        drums.push(ev(120, TrackEventKind::Meta(MetaMessage::Marker(b"x"))));
        if i == 20 {
            piano.push(program(0, 0, 40)); // program change mid-track
        }
    }
    piano.push(end());
    drums.push(end());
    let bytes = smf_bytes(Format::Parallel, metrical(480), vec![meta, piano, drums]);
    let (score, _) = midi::parse(&bytes).unwrap();
    assert!(score.notes.iter().any(|n| n.is_drum && n.channel == 9));
    assert!(score.notes.iter().any(|n| n.program == 40));
    assert_eq!(score.tempos.len(), 3);
    assert_eq!(score.time_signatures.len(), 3);
    assert_round_trip(&score);
    // And through a MIDI file written by cadenza.
    let v = vocab();
    let (ids, _) = encode(&score, &v);
    let (decoded, rep) = decode(&ids, &v);
    assert!(rep.is_clean());
    let written = midi::to_bytes(&cadenza::tokenizer::to_output_resolution(&decoded)).unwrap();
    let (back, _) = midi::parse(&written).unwrap();
    let (ids2, _) = encode(&back, &v);
    assert_eq!(ids, ids2);
}

#[test]
fn notes_beyond_the_pitch_range_are_dropped_and_counted() {
    let t = vec![
        on(0, 0, 10, 80),
        off(480, 0, 10),
        on(0, 0, 60, 80),
        off(480, 0, 60),
        end(),
    ];
    let bytes = smf_bytes(Format::SingleTrack, metrical(480), vec![t]);
    let (score, _) = midi::parse(&bytes).unwrap();
    let (_, q) = encode(&score, &vocab());
    assert_eq!(q.dropped_out_of_range, 1);
    assert_eq!(q.notes_out, 1);
}

#[test]
fn smpte_timing_is_converted() {
    // 25 fps x 40 subframes = 1000 ticks per second.
    let t = vec![
        on(0, 0, 60, 80),
        off(1000, 0, 60),
        on(0, 0, 62, 80),
        off(500, 0, 62),
        end(),
    ];
    let bytes = smf_bytes(
        Format::SingleTrack,
        Timing::Timecode(midly::Fps::Fps25, 40),
        vec![t],
    );
    let (score, report) = midi::parse(&bytes).unwrap();
    assert!(report.smpte_converted);
    // One second = two quarters at 120 BPM.
    assert!((score.tick_to_seconds(score.notes[1].start) - 1.0).abs() < 1e-6);
    assert!((score.duration_seconds() - 1.5).abs() < 1e-6);
    assert_round_trip(&score);
}

#[test]
fn format_0_and_format_2() {
    let t = vec![program(0, 3, 24), on(0, 3, 60, 80), off(480, 3, 60), end()];
    let (s0, _) = midi::parse(&smf_bytes(
        Format::SingleTrack,
        metrical(96),
        vec![t.clone()],
    ))
    .unwrap();
    assert_eq!(s0.notes[0].program, 24);
    let (s2, _) = midi::parse(&smf_bytes(
        Format::Sequential,
        metrical(96),
        vec![t.clone(), t],
    ))
    .unwrap();
    // Format 2: the second song follows the first.
    assert_eq!(
        s2.notes.iter().map(|n| n.start).collect::<Vec<_>>(),
        vec![0, 480]
    );
}

#[test]
fn truncated_and_garbage_bytes_are_errors_or_warnings_never_panics() {
    let good = std::fs::read("midi_samples/oneills-reel-4-4.mid").unwrap();
    for cut in [0, 5, 13, 14, 20, good.len() / 2, good.len() - 1] {
        match midi::parse(&good[..cut]) {
            Err(e) => assert!(!e.is_empty()),
            Ok((_, r)) => assert!(r.truncated_tracks > 0, "cut at {cut} went unnoticed"),
        }
    }
    assert!(midi::parse(b"hello, this is not a MIDI file at all").is_err());
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("junk.mid");
    std::fs::write(&p, b"\x00\x01garbage").unwrap();
    let err = midi::read_file(&p).unwrap_err().to_string();
    assert!(err.contains("junk.mid"), "{err}");
}

/// The bundled sample prompts.
const SAMPLES: [&str; 3] = [
    "oneills-jig-6-8.mid",
    "oneills-reel-4-4.mid",
    "oneills-air-3-4.mid",
];

fn sample_score(name: &str) -> midi::Score {
    midi::read_file(&std::path::Path::new("midi_samples").join(name))
        .unwrap()
        .0
}

#[test]
fn samples_round_trip_and_validate() {
    for f in SAMPLES {
        let score = sample_score(f);
        assert!(!score.notes.is_empty());
        assert_round_trip(&score);
    }
}

#[test]
fn validator_reports_the_first_invalid_token_and_decoder_skips() {
    let v = vocab();
    let (score, _) =
        midi::read_file(std::path::Path::new("midi_samples/oneills-jig-6-8.mid")).unwrap();
    let (mut ids, _) = encode(&score, &v);
    let dur = v.id(Token::Duration(3)).unwrap();
    // A Duration right after a Position is out of place.
    let at = ids
        .iter()
        .position(|&i| v.kind(i) == Some(TokenType::Position))
        .unwrap()
        + 1;
    ids.insert(at, dur);
    let err = validate(&ids, &v).unwrap_err();
    assert_eq!(err.index, at);
    assert!(err.expected.contains(&TokenType::Program));
    let (decoded, rep) = decode(&ids, &v);
    assert_eq!(rep.skipped, 1);
    assert_eq!(decoded.notes.len(), score.notes.len());
    // A Position going backwards inside a bar.
    let mut g = Grammar::new(&v);
    for id in [
        v.id(Token::Bar).unwrap(),
        v.id(Token::Position(10)).unwrap(),
        v.id(Token::Tempo(40)).unwrap(),
    ] {
        g.push(id).unwrap();
    }
    assert!(!g.allows(v.id(Token::Position(5)).unwrap()));
    assert!(g.allows(v.id(Token::Position(11)).unwrap()));
    assert!(g.allows(EOS_ID));
}

fn arb_score() -> impl Strategy<Value = Score> {
    let note = (
        0u64..3000,
        0u64..5000,
        0u8..128,
        1u8..128,
        0u8..128,
        any::<bool>(),
    )
        .prop_map(
            |(start, duration, pitch, velocity, program, is_drum)| Note {
                start,
                duration,
                pitch,
                velocity,
                program: if is_drum { 0 } else { program },
                channel: if is_drum { 9 } else { 0 },
                is_drum,
            },
        );
    let tempo = (0u64..3000, 100_000u32..3_000_000).prop_map(|(tick, us)| TempoChange {
        tick,
        us_per_quarter: us,
    });
    let sig = (0u64..3000, 1u8..16, 0u32..5).prop_map(|(tick, n, dp)| TimeSignature {
        tick,
        numerator: n,
        denominator: 1 << dp,
    });
    (
        prop::sample::select(vec![24u32, 96, 480, 10_080, 7]),
        prop::collection::vec(note, 0..60),
        prop::collection::vec(tempo, 0..4),
        prop::collection::vec(sig, 0..4),
    )
        .prop_map(|(tpq, notes, tempos, sigs)| {
            let mut s = Score::new(tpq);
            s.notes = notes;
            s.tempos = tempos;
            s.time_signatures = sigs;
            s.sort();
            s
        })
}

/// A random canonical sequence: sampled from the grammar's own mask.
fn arb_tokens() -> impl Strategy<Value = Vec<u32>> {
    arb_tokens_for(1)
}

/// A random canonical sequence of the vocabulary `option_vocabs()[which]`.
fn arb_tokens_for(which: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(any::<u32>(), 1..300).prop_map(move |choices| {
        let v = &option_vocabs()[which];
        let mut g = Grammar::new(v);
        let mut out = Vec::new();
        let mut mask = vec![false; v.len()];
        for c in choices {
            g.fill_mask(&mut mask);
            mask[EOS_ID as usize] = false;
            mask[cadenza::tokenizer::BOS_ID as usize] = false;
            let allowed: Vec<u32> = (0..v.len() as u32).filter(|&i| mask[i as usize]).collect();
            // Favour notes over structure so that pieces are not mostly bars.
            let id = allowed[c as usize % allowed.len()];
            g.push(id).unwrap();
            out.push(id);
        }
        // Close the piece canonically: end a bar's content and drop bare trailing bars.
        while let Some(&last) = out.last() {
            match v.kind(last) {
                Some(TokenType::Duration) | Some(TokenType::Tempo) | Some(TokenType::TimeSig) => {
                    break
                }
                _ => {
                    out.pop();
                }
            }
        }
        out
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn decode_of_encode_is_the_quantized_score(score in arb_score()) {
        let v = vocab();
        let (q, _) = quantize(&score, v.config());
        let ids = encode_quantized(&q, &v);
        prop_assert!(validate(&ids, &v).is_ok());
        let (d, rep) = decode(&ids, &v);
        prop_assert!(rep.is_clean());
        prop_assert_eq!(&d, &q);
        prop_assert_eq!(encode_quantized(&d, &v), ids);
    }

    #[test]
    fn encode_of_decode_is_the_tokens(ids in arb_tokens()) {
        let v = vocab();
        prop_assume!(!ids.is_empty());
        let (d, rep) = decode(&ids, &v);
        prop_assert!(rep.is_clean(), "{:?}", rep);
        prop_assume!(!d.notes.is_empty());
        prop_assert_eq!(encode_quantized(&d, &v), ids);
    }

    #[test]
    fn decode_never_panics_on_random_ids(ids in prop::collection::vec(0u32..1000, 0..400)) {
        let v = vocab();
        let (_, rep) = decode(&ids, &v);
        prop_assert!(rep.skipped + rep.unknown + rep.after_eos <= ids.len());
    }

    #[test]
    fn parser_never_panics_on_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        if let Ok((s, _)) = midi::parse(&bytes) {
            let _ = encode(&s, &vocab());
        }
    }

    #[test]
    fn parser_never_panics_on_mutated_files(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..20),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = std::fs::read("midi_samples/oneills-jig-6-8.mid").unwrap();
        for (i, b) in edits {
            let i = i.index(bytes.len());
            bytes[i] = b;
        }
        let keep = cut.index(bytes.len() + 1);
        bytes.truncate(keep.max(bytes.len() / 2));
        if let Ok((s, _)) = midi::parse(&bytes) {
            let (ids, _) = encode(&s, &vocab());
            let (d, rep) = decode(&ids, &vocab());
            prop_assert!(rep.is_clean());
            let _ = midi::to_bytes(&d);
        }
    }
}

#[test]
fn committed_vocabulary_is_the_default_one() {
    let file = Vocab::load(std::path::Path::new("vocab/remi-default.json")).unwrap();
    assert_eq!(
        file.hash(),
        vocab().hash(),
        "run `cadenza vocab` to refresh vocab/remi-default.json"
    );
}

// ---- Vocabulary options: program_changes and velocities ----

/// The hash of the default vocabulary as committed before the options existed.
const DEFAULT_VOCAB_HASH: &str = "496d5d98e09792881dba69ca61cbcd78";

#[test]
fn default_vocabulary_hash_and_ids_are_unchanged_by_the_options() {
    let v = vocab();
    assert_eq!(v.hash(), DEFAULT_VOCAB_HASH);
    assert_eq!(v.len(), 877);
    // The defaults of the new options are not written, so old files read the same.
    let json = serde_json::to_string(v.config()).unwrap();
    for key in ["program_changes", "velocities", "default_velocity"] {
        assert!(!json.contains(key), "{json}");
    }
    let file = Vocab::load(std::path::Path::new("vocab/remi-default.json")).unwrap();
    assert_eq!(file.hash(), DEFAULT_VOCAB_HASH);
    assert_eq!(file.config(), &RemiConfig::default());
    for id in 0..v.len() as u32 {
        assert_eq!(file.string(id), v.string(id));
    }
    // Setting an option to its default value changes nothing.
    assert_eq!(option_vocabs()[1].hash(), DEFAULT_VOCAB_HASH);
}

#[test]
fn option_vocabularies_differ_and_round_trip_through_their_files() {
    let vs = option_vocabs();
    let mut hashes: Vec<&str> = vs.iter().map(|v| v.hash()).collect();
    hashes.sort();
    hashes.dedup();
    assert_eq!(hashes.len(), 4);
    for (i, v) in vs.iter().enumerate() {
        let velocities = i % 2 == 1;
        let n_vel = v.range(TokenType::Velocity).len();
        assert_eq!(n_vel, if velocities { 32 } else { 0 });
        assert_eq!(v.len(), 877 - 32 + n_vel);
        // Ids before the velocity block do not move.
        for id in 0..v.range(TokenType::Velocity).start {
            assert_eq!(v.string(id), vs[1].string(id));
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("v.json");
        v.save(&p).unwrap();
        let w = Vocab::load(&p).unwrap();
        assert_eq!((w.hash(), w.config()), (v.hash(), v.config()));
    }
    for (path, which) in [
        ("vocab/remi-compact.json", 2),
        // The shipped model is trained on the compact vocabulary.
        ("models/cadenza-small/vocab.json", 2),
        ("vocab/remi-program-changes.json", 3),
    ] {
        let file = Vocab::load(std::path::Path::new(path)).unwrap();
        assert_eq!(file.hash(), vs[which].hash(), "{path}: run `cadenza vocab`");
    }
}

#[test]
fn grammar_under_program_changes() {
    for v in &option_vocabs()[2..] {
        let id = |t: Token| v.id(t).unwrap();
        let velocity: Vec<Token> = if v.config().velocities {
            vec![Token::Velocity(20)]
        } else {
            vec![]
        };
        let note = |head: Vec<Token>| {
            let mut n = head;
            n.extend(velocity.iter().copied());
            n.push(Token::Duration(11));
            n
        };
        let mut g = Grammar::new(v);
        for t in [Token::Bar, Token::Position(0)] {
            g.push(id(t)).unwrap();
        }
        // No program yet: the first note needs its Program token.
        assert!(!g.allows(id(Token::Pitch(60))));
        assert!(g.allows(id(Token::Program(0))));
        for t in note(vec![Token::Program(0), Token::Pitch(60)]) {
            g.push(id(t)).unwrap();
        }
        // Same position, same program: no Program token, pitches in order.
        assert!(g.allows(id(Token::Pitch(64))));
        assert!(!g.allows(id(Token::Pitch(59))));
        assert!(!g.allows(id(Token::PitchDrum(36))));
        assert!(
            !g.allows(id(Token::Program(0))),
            "repeats the current program"
        );
        assert!(g.allows(id(Token::Program(24))));
        assert!(g.allows(id(Token::Program(cadenza::tokenizer::DRUMS))));
        for t in note(vec![
            Token::Program(cadenza::tokenizer::DRUMS),
            Token::PitchDrum(36),
        ]) {
            g.push(id(t)).unwrap();
        }
        assert!(!g.allows(id(Token::Program(24))), "drums come last");
        // The program carries to the next bar: drums go on without a Program.
        for t in [Token::Bar, Token::Position(3)] {
            g.push(id(t)).unwrap();
        }
        assert!(g.allows(id(Token::PitchDrum(30))));
        assert!(!g.allows(id(Token::Pitch(60))));
        assert!(!g.allows(id(Token::Program(cadenza::tokenizer::DRUMS))));
        assert!(g.allows(id(Token::Program(0))));
        for t in note(vec![Token::PitchDrum(30)]) {
            g.push(id(t)).unwrap();
        }
        // And the decoder plays each note with the right program.
        let mut ids = vec![id(Token::Bar), id(Token::Position(0))];
        ids.extend(
            note(vec![Token::Program(0), Token::Pitch(60)])
                .into_iter()
                .map(id),
        );
        ids.extend(note(vec![Token::Pitch(64)]).into_iter().map(id));
        ids.push(id(Token::Position(6)));
        ids.extend(note(vec![Token::Pitch(62)]).into_iter().map(id));
        ids.extend(
            note(vec![Token::Program(33), Token::Pitch(40)])
                .into_iter()
                .map(id),
        );
        ids.push(id(Token::Bar));
        ids.push(id(Token::Position(0)));
        ids.extend(note(vec![Token::Pitch(41)]).into_iter().map(id));
        validate(&ids, v).unwrap();
        let (d, rep) = decode(&ids, v);
        assert!(rep.is_clean(), "{rep:?}");
        let got: Vec<_> = d
            .notes
            .iter()
            .map(|n| (n.start, n.program, n.pitch))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 0, 60),
                (0, 0, 64),
                (6, 0, 62),
                (6, 33, 40),
                (48, 33, 41)
            ]
        );
        assert_eq!(encode_quantized(&d, v), ids);
        // A pitch before any program is skipped by the decoder.
        let (d, rep) = decode(
            &[id(Token::Bar), id(Token::Position(0)), id(Token::Pitch(60))],
            v,
        );
        assert_eq!((d.notes.len(), rep.skipped), (0, 1));
    }
}

#[test]
fn grammar_without_velocities() {
    for (i, v) in option_vocabs()
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 2 == 0)
    {
        let id = |t: Token| v.id(t).unwrap();
        assert_eq!(v.id(Token::Velocity(0)), None);
        let prefix = [
            id(Token::Bar),
            id(Token::Position(0)),
            id(Token::Program(0)),
            id(Token::Pitch(60)),
        ];
        assert_eq!(
            cadenza::tokenizer::next_types(&prefix, v).unwrap(),
            vec![TokenType::Duration]
        );
        let mut ids = prefix.to_vec();
        ids.push(id(Token::Duration(11)));
        let (d, rep) = decode(&ids, v);
        assert!(rep.is_clean());
        assert_eq!(d.notes[0].velocity, v.config().default_velocity);
        assert_eq!(encode_quantized(&d, v), ids, "options {i}");
    }
}

#[test]
fn samples_are_faithful_under_every_option() {
    for f in SAMPLES {
        let score = sample_score(f);
        for v in option_vocabs() {
            let fid = fidelity::measure(&score, v);
            assert!(fid.is_perfect(), "{f} {:?}: {fid:?}", v.config());
            let (ids, _) = encode(&score, v);
            validate(&ids, v).unwrap();
        }
    }
}

/// Several instruments and drums, many notes at the same positions.
fn arb_multi_program_score() -> impl Strategy<Value = Score> {
    let note = (
        0u64..16,
        1u64..4,
        40u8..80,
        1u8..128,
        prop::sample::select(vec![0u8, 0, 24, 33, 40, 73, 128]),
    )
        .prop_map(|(slot, len, pitch, velocity, program)| {
            let is_drum = program == 128;
            Note {
                start: slot * 120,
                duration: len * 120,
                pitch,
                velocity,
                program: if is_drum { 0 } else { program },
                channel: if is_drum { 9 } else { 0 },
                is_drum,
            }
        });
    prop::collection::vec(note, 1..50).prop_map(|notes| {
        let mut s = Score::new(480);
        s.notes = notes;
        s.sort();
        s
    })
}

/// `quantize` under `cfg` is `quantize` under the defaults with velocities
/// replaced by `default_velocity` when velocities are off.
fn expected_quantized(score: &Score, cfg: &RemiConfig) -> Score {
    let (mut q, _) = quantize(score, &RemiConfig::default());
    if !cfg.velocities {
        for n in &mut q.notes {
            n.velocity = cfg.default_velocity;
        }
        q.sort();
    }
    q
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn options_decode_of_encode_is_the_quantized_score(
        score in arb_score(),
        which in 0usize..4,
    ) {
        let v = &option_vocabs()[which];
        let (q, _) = quantize(&score, v.config());
        prop_assert_eq!(&q, &expected_quantized(&score, v.config()));
        let ids = encode_quantized(&q, v);
        prop_assert!(validate(&ids, v).is_ok());
        let (d, rep) = decode(&ids, v);
        prop_assert!(rep.is_clean());
        prop_assert_eq!(&d, &q);
        prop_assert_eq!(encode_quantized(&d, v), ids);
    }

    #[test]
    fn options_encode_of_decode_is_the_tokens(
        (which, ids) in (0usize..4).prop_flat_map(|w| (Just(w), arb_tokens_for(w))),
    ) {
        let v = &option_vocabs()[which];
        prop_assume!(!ids.is_empty());
        let (d, rep) = decode(&ids, v);
        prop_assert!(rep.is_clean(), "{:?}", rep);
        prop_assume!(!d.notes.is_empty());
        prop_assert_eq!(encode_quantized(&d, v), ids);
    }

    #[test]
    fn options_keep_every_notes_program(score in arb_multi_program_score(), which in 0usize..4) {
        let v = &option_vocabs()[which];
        let cfg = v.config();
        let q = expected_quantized(&score, cfg);
        let ids = encode_quantized(&q, v);
        prop_assert!(validate(&ids, v).is_ok());
        let (d, rep) = decode(&ids, v);
        prop_assert!(rep.is_clean());
        let key = |s: &Score| -> Vec<(u64, bool, u8, u8)> {
            s.notes.iter().map(|n| (n.start, n.is_drum, n.program, n.pitch)).collect()
        };
        prop_assert_eq!(key(&d), key(&q));
        prop_assert_eq!(&d, &q);
        // One Program token per note, or per change of program.
        let programs: Vec<(bool, u8)> = q.notes.iter().map(|n| (n.is_drum, n.program)).collect();
        let changes = 1 + programs.windows(2).filter(|w| w[0] != w[1]).count();
        let n_program = ids.iter().filter(|&&i| v.kind(i) == Some(TokenType::Program)).count();
        prop_assert_eq!(n_program, if cfg.program_changes { changes } else { q.notes.len() });
        let n_velocity = ids.iter().filter(|&&i| v.kind(i) == Some(TokenType::Velocity)).count();
        prop_assert_eq!(n_velocity, if cfg.velocities { q.notes.len() } else { 0 });
    }

    #[test]
    fn options_decode_never_panics_on_random_ids(
        ids in prop::collection::vec(0u32..1000, 0..400),
        which in 0usize..4,
    ) {
        let v = &option_vocabs()[which];
        let (_, rep) = decode(&ids, v);
        prop_assert!(rep.skipped + rep.unknown + rep.after_eos <= ids.len());
    }
}
