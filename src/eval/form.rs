//! Musical form measured on REMI token streams: do bars come back, at which
//! distances, and does the first strain return? (The definitions are those
//! of the form notes, `docs/form.md`.)
//!
//! * A **bar** is the set of its notes as (position in bar, pitch, duration
//!   index), read from the tokens between two `Bar` tokens (the last bar
//!   runs to EOS or the end). A note is a `Pitch` token followed, with only
//!   a `Velocity` between, by its `Duration`, at the bar's current
//!   `Position`; a pitch before the bar's first `Position` is not a note.
//!   Drums (`PitchDrum`) and `Program` tokens are left out, so with several
//!   instruments a pitch is the pitch, whoever plays it. Tokens before the
//!   first `Bar` (BOS) belong to no bar. Bars are numbered from 1, the
//!   first bar of the piece. At most [`MAX_FORM_BARS`] bars are read.
//! * The **similarity** of two bars is the Jaccard index of their sets
//!   (|A n B| / |A u B|): 1 for the same notes, 0 for none in common. A pair
//!   where either bar is empty is *undefined* and skipped by every mean
//!   below (it never counts as 0).
//! * The **bar-similarity curve** `L_t`, t = 1..=[`MAX_LAG`]: the mean
//!   similarity of bars i and i + t over the defined pairs of the piece;
//!   undefined when the piece has no defined pair at lag t.
//! * The **strain return** for P bars: the mean similarity of bar P + k to
//!   bar k over k = 1..=P (defined pairs only); undefined when the piece has
//!   fewer than 2P bars or no defined pair.
//! * The **section recall** for a window W: the share of the non-empty bars
//!   j that have W bars before them (j > W) for which some bar i <= j - W
//!   has similarity >= [`NEAR_COPY`]; undefined when no non-empty bar has W
//!   bars before it.
//! * Over a set of pieces each piece weighs once: a summary value is the
//!   mean of the pieces' defined values, undefined when none is, and the
//!   strain share is the share of the pieces with a defined strain return
//!   whose strain return is >= [`NEAR_COPY`].
//!
//! Every function is total: any token stream gives finite values or None.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::tokenizer::{Token, Vocab, BAR_ID};

/// Longest lag of the bar-similarity curve, in bars.
pub const MAX_LAG: usize = 32;
/// The lags of the curve shown in tables.
pub const TABLE_LAGS: [usize; 6] = [1, 2, 4, 8, 16, 32];
/// Default strain length P (bars P+1..2P against bars 1..P).
pub const DEFAULT_STRAIN_BARS: usize = 8;
/// The windows W of the section recall, in bars.
pub const SECTION_WINDOWS: [usize; 2] = [16, 32];
/// Similarity from which a bar is a near copy of another (also the strain
/// return that counts as a returning strain).
pub const NEAR_COPY: f64 = 0.5;
/// Most bars of a piece that are read (the measures are quadratic in bars).
pub const MAX_FORM_BARS: usize = 2048;

/// One note of a bar: (position in bar, pitch, duration index).
pub type BarNote = (u16, u8, u16);

/// A bar: its distinct notes, sorted.
pub type Bar = Vec<BarNote>;

/// The bars of a token stream (see the module doc), each sorted and without
/// duplicates.
pub fn bars(ids: &[u32], vocab: &Vocab) -> Vec<Bar> {
    let mut out: Vec<Bar> = Vec::new();
    let mut pos: Option<u16> = None;
    // The pitch waiting for its duration.
    let mut pending: Option<u8> = None;
    for &id in ids {
        let Some(tok) = vocab.token(id) else {
            pending = None;
            continue;
        };
        match tok {
            Token::Eos => break,
            Token::Bar => {
                if out.len() == MAX_FORM_BARS {
                    break;
                }
                out.push(Vec::new());
                pos = None;
                pending = None;
            }
            Token::Position(p) => {
                pos = Some(p);
                pending = None;
            }
            Token::Pitch(p) => pending = pos.map(|_| p),
            Token::Velocity(_) => {}
            Token::Duration(d) => {
                if let (Some(bar), Some(at), Some(pitch)) = (out.last_mut(), pos, pending) {
                    bar.push((at, pitch, d));
                }
                pending = None;
            }
            _ => pending = None,
        }
    }
    for b in &mut out {
        b.sort_unstable();
        b.dedup();
    }
    out
}

/// Jaccard index of two bars (sorted, without duplicates); None when either
/// is empty.
pub fn similarity(a: &[BarNote], b: &[BarNote]) -> Option<f64> {
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let (mut i, mut j, mut common) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                common += 1;
                i += 1;
                j += 1;
            }
        }
    }
    Some(common as f64 / (a.len() + b.len() - common) as f64)
}

/// Mean of the defined values; None when there is none.
fn mean_defined(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    mean_count(values).0
}

/// `L_t` for t = 1..=`max_lag` (index t - 1): the mean similarity of bars i
/// and i + t over the defined pairs.
pub fn similarity_curve(bars: &[Bar], max_lag: usize) -> Vec<Option<f64>> {
    (1..=max_lag)
        .map(|t| {
            mean_defined(
                bars.iter()
                    .zip(bars.iter().skip(t))
                    .map(|(a, b)| similarity(a, b)),
            )
        })
        .collect()
}

/// The strain return for `p` bars: the mean similarity of bar p + k to bar
/// k, k = 1..=p; None when the piece has fewer than 2p bars (or p is 0) or
/// no pair is defined.
pub fn strain_return(bars: &[Bar], p: usize) -> Option<f64> {
    if p == 0 || bars.len() < 2 * p {
        return None;
    }
    mean_defined((0..p).map(|k| similarity(&bars[k], &bars[p + k])))
}

/// The section recall for window `w`: the share of non-empty bars with `w`
/// bars before them that have a near copy `w` or more bars earlier.
pub fn section_recall(bars: &[Bar], w: usize) -> Option<f64> {
    let (mut found, mut counted) = (0usize, 0usize);
    for j in w..bars.len() {
        if bars[j].is_empty() {
            continue;
        }
        counted += 1;
        // Bar j + 1 (from 1) looks at bars 1..=j + 1 - w, indices 0..=j - w.
        if bars[..=j - w]
            .iter()
            .any(|b| similarity(b, &bars[j]).is_some_and(|s| s >= NEAR_COPY))
        {
            found += 1;
        }
    }
    (counted > 0).then(|| found as f64 / counted as f64)
}

/// The bars x bars self-similarity matrix (row i, column j: bars i + 1 and
/// j + 1); None where either bar is empty.
pub fn self_similarity(bars: &[Bar]) -> Vec<Vec<Option<f64>>> {
    bars.iter()
        .map(|a| bars.iter().map(|b| similarity(a, b)).collect())
        .collect()
}

/// The bar (an index into [`bars`]) each token of `ids` stands in: a `Bar`
/// token opens its bar; tokens before the first `Bar`, and from EOS or the
/// [`MAX_FORM_BARS`] limit on, stand in none. Same length as `ids`.
pub fn token_bars(ids: &[u32], vocab: &Vocab) -> Vec<Option<usize>> {
    let mut out = Vec::with_capacity(ids.len());
    let mut bar: Option<usize> = None;
    let mut ended = false;
    for &id in ids {
        match vocab.token(id) {
            _ if ended => {}
            Some(Token::Eos) => ended = true,
            Some(Token::Bar) => {
                let next = bar.map_or(0, |b| b + 1);
                if next == MAX_FORM_BARS {
                    ended = true;
                } else {
                    bar = Some(next);
                }
            }
            _ => {}
        }
        out.push(if ended { None } else { bar });
    }
    out
}

/// How each bar stands to the bars before it, for the return probe of
/// `cadenza eval`: `Some(true)` when an earlier bar at least `min_lag` bars
/// back has exactly its notes (a bar the past predicts), `Some(false)` when
/// no earlier bar is a near copy (similarity >= [`NEAR_COPY`]) at any lag (a
/// bar the past cannot give), None otherwise (empty, or partly like an
/// earlier bar).
pub fn bar_returns(bars: &[Bar], min_lag: usize) -> Vec<Option<bool>> {
    (0..bars.len())
        .map(|j| {
            if bars[j].is_empty() {
                return None;
            }
            if j >= min_lag && bars[..=j - min_lag].iter().any(|b| *b == bars[j]) {
                return Some(true);
            }
            let near = bars[..j]
                .iter()
                .any(|b| similarity(b, &bars[j]).is_some_and(|s| s >= NEAR_COPY));
            (!near).then_some(false)
        })
        .collect()
}

/// For every token of `ids`, how many tokens back the nearest earlier bar with exactly
/// its bar's tokens begins, None when no earlier bar has them (or the token precedes the
/// first `Bar`). Unlike [`bars`], a bar here is its tokens verbatim, from its `Bar` token
/// up to the next one (or the end of `ids`), as in `scripts/form/far-repeats.py`: every
/// token of a bar gets the distance between the two bars' `Bar` tokens, which is how far
/// back a model must look to copy the token. It sorts the context gain's positions
/// (`cadenza eval --context-cut`) by where a copy of them lies.
pub fn bar_copy_distances(ids: &[u32]) -> Vec<Option<usize>> {
    let starts: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] == BAR_ID).collect();
    let mut out = vec![None; ids.len()];
    let mut last_seen: HashMap<&[u32], usize> = HashMap::new();
    for (j, &s) in starts.iter().enumerate() {
        let end = starts.get(j + 1).copied().unwrap_or(ids.len());
        let copy = last_seen.insert(&ids[s + 1..end], s).map(|prev| s - prev);
        out[s..end].fill(copy);
    }
    out
}

/// The form measures of one piece.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PieceForm {
    /// Where the piece came from (a file, or a dataset piece's source).
    pub source: String,
    /// Bars read.
    pub bars: usize,
    /// `L_t` for t = 1..=32 (element t - 1); null where undefined.
    pub similarity_curve: Vec<Option<f64>>,
    /// Strain return for the P of [`FormSummary::strain_bars`]; null where
    /// undefined.
    pub strain_return: Option<f64>,
    /// Section recall by window W (keys "16", "32"); null where undefined.
    pub section_recall: BTreeMap<usize, Option<f64>>,
}

/// Measures one piece's bars, with strain length `strain_bars`.
pub fn piece_form(source: &str, bars: &[Bar], strain_bars: usize) -> PieceForm {
    PieceForm {
        source: source.to_string(),
        bars: bars.len(),
        similarity_curve: similarity_curve(bars, MAX_LAG),
        strain_return: strain_return(bars, strain_bars),
        section_recall: SECTION_WINDOWS
            .iter()
            .map(|&w| (w, section_recall(bars, w)))
            .collect(),
    }
}

/// The form measures of a set of pieces, each piece weighing once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FormSummary {
    /// Pieces measured.
    pub pieces: usize,
    /// The strain length P.
    pub strain_bars: usize,
    /// Mean `L_t` over the pieces where it is defined, t = 1..=32.
    pub similarity_curve: Vec<Option<f64>>,
    /// Pieces with a defined `L_t`, t = 1..=32.
    pub similarity_pieces: Vec<usize>,
    /// Mean strain return over the pieces where it is defined.
    pub strain_return: Option<f64>,
    /// Pieces with a defined strain return (at least 2P bars).
    pub strain_pieces: usize,
    /// Share of those pieces whose strain return is >= 0.5.
    pub strain_share: Option<f64>,
    /// Mean section recall by window W over the pieces where it is defined.
    pub section_recall: BTreeMap<usize, Option<f64>>,
    /// Pieces with a defined section recall, by window W.
    pub section_pieces: BTreeMap<usize, usize>,
}

/// Mean and count of the defined values.
fn mean_count(values: impl Iterator<Item = Option<f64>>) -> (Option<f64>, usize) {
    let v: Vec<f64> = values.flatten().collect();
    let mean = (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    (mean, v.len())
}

/// Averages pieces' form measures (see the module doc).
pub fn summarize(pieces: &[PieceForm], strain_bars: usize) -> FormSummary {
    let (curve, counts): (Vec<_>, Vec<_>) = (0..MAX_LAG)
        .map(|k| {
            mean_count(
                pieces
                    .iter()
                    .map(|p| p.similarity_curve.get(k).copied().flatten()),
            )
        })
        .unzip();
    let (strain_return, strain_pieces) = mean_count(pieces.iter().map(|p| p.strain_return));
    let returning = pieces
        .iter()
        .filter(|p| p.strain_return.is_some_and(|s| s >= NEAR_COPY))
        .count();
    let mut section_recall = BTreeMap::new();
    let mut section_pieces = BTreeMap::new();
    for w in SECTION_WINDOWS {
        let (m, n) = mean_count(
            pieces
                .iter()
                .map(|p| p.section_recall.get(&w).copied().flatten()),
        );
        section_recall.insert(w, m);
        section_pieces.insert(w, n);
    }
    FormSummary {
        pieces: pieces.len(),
        strain_bars,
        similarity_curve: curve,
        similarity_pieces: counts,
        strain_return,
        strain_pieces,
        strain_share: (strain_pieces > 0).then(|| returning as f64 / strain_pieces as f64),
        section_recall,
        section_pieces,
    }
}

/// A value for a table: three decimals, or "-" when undefined.
pub fn cell(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{x:.3}"))
}

/// A markdown table of the form measures of generated and real pieces, side
/// by side, with the number of pieces each value is a mean over.
pub fn markdown(generated: &FormSummary, real: &FormSummary) -> String {
    let mut out = String::from(
        "| form measure | generated | real | generated pieces | real pieces |\n\
         |---|---:|---:|---:|---:|\n",
    );
    let mut row = |name: String, g: Option<f64>, r: Option<f64>, gn: usize, rn: usize| {
        out.push_str(&format!(
            "| {name} | {} | {} | {gn} | {rn} |\n",
            cell(g),
            cell(r)
        ));
    };
    for t in TABLE_LAGS {
        row(
            format!("bar similarity L_{t}"),
            generated.similarity_curve[t - 1],
            real.similarity_curve[t - 1],
            generated.similarity_pieces[t - 1],
            real.similarity_pieces[t - 1],
        );
    }
    let p = generated.strain_bars;
    row(
        format!("strain return (P = {p})"),
        generated.strain_return,
        real.strain_return,
        generated.strain_pieces,
        real.strain_pieces,
    );
    row(
        format!("share of pieces with strain return >= {NEAR_COPY}"),
        generated.strain_share,
        real.strain_share,
        generated.strain_pieces,
        real.strain_pieces,
    );
    for w in SECTION_WINDOWS {
        row(
            format!("section recall (W = {w})"),
            generated.section_recall[&w],
            real.section_recall[&w],
            generated.section_pieces[&w],
            real.section_pieces[&w],
        );
    }
    out
}

/// A markdown table with one row per piece: bars, `L_t` at the table lags,
/// strain return and section recall.
pub fn piece_table(pieces: &[PieceForm]) -> String {
    let mut out = String::from("| piece | bars |");
    for t in TABLE_LAGS {
        out.push_str(&format!(" L_{t} |"));
    }
    out.push_str(" strain return |");
    for w in SECTION_WINDOWS {
        out.push_str(&format!(" recall W={w} |"));
    }
    out.push_str("\n|---|---:|");
    out.push_str(&"---:|".repeat(TABLE_LAGS.len() + 1 + SECTION_WINDOWS.len()));
    out.push('\n');
    for p in pieces {
        out.push_str(&format!(
            "| {} | {} |",
            p.source.replace('|', "\\|"),
            p.bars
        ));
        for t in TABLE_LAGS {
            out.push_str(&format!(
                " {} |",
                cell(p.similarity_curve.get(t - 1).copied().flatten())
            ));
        }
        out.push_str(&format!(" {} |", cell(p.strain_return)));
        for w in SECTION_WINDOWS {
            out.push_str(&format!(
                " {} |",
                cell(p.section_recall.get(&w).copied().flatten())
            ));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{RemiConfig, BAR_ID, BOS_ID, EOS_ID};

    fn vocab() -> Vocab {
        Vocab::new(RemiConfig::default()).unwrap()
    }

    /// Tokens of bars given as (position, pitch, duration index) notes, in
    /// the encoder's order (Position, Program, Pitch, Velocity, Duration).
    fn stream(v: &Vocab, bars: &[Vec<BarNote>]) -> Vec<u32> {
        let id = |t: Token| v.id(t).unwrap();
        let mut ids = vec![BOS_ID];
        for b in bars {
            ids.push(BAR_ID);
            for &(pos, pitch, dur) in b {
                ids.extend([
                    id(Token::Position(pos)),
                    id(Token::Program(0)),
                    id(Token::Pitch(pitch)),
                    id(Token::Velocity(10)),
                    id(Token::Duration(dur)),
                ]);
            }
        }
        ids.push(EOS_ID);
        ids
    }

    /// A bar of four notes whose pitches start at `base`.
    fn motif(base: u8) -> Vec<BarNote> {
        (0..4).map(|k| (k as u16 * 12, base + 2 * k, 4)).collect()
    }

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-12)
    }

    #[test]
    fn similarity_of_identical_disjoint_overlapping_and_empty_bars() {
        let a = motif(60);
        assert_eq!(similarity(&a, &a), Some(1.0));
        assert_eq!(similarity(&a, &motif(70)), Some(0.0));
        // two of four notes shared: 2 / 6
        let mut b = a.clone();
        b[2].1 = 90;
        b[3].1 = 91;
        b.sort_unstable();
        assert!(close(similarity(&a, &b), 2.0 / 6.0));
        assert_eq!(similarity(&a, &[]), None);
        assert_eq!(similarity(&[], &[]), None);
    }

    #[test]
    fn token_bars_follow_the_bar_tokens_and_stop_at_eos() {
        let v = vocab();
        let ids = stream(&v, &[motif(60), vec![], motif(62)]);
        let tb = token_bars(&ids, &v);
        assert_eq!(tb.len(), ids.len());
        assert_eq!(tb[0], None, "BOS stands in no bar");
        // BOS, Bar, 4 notes x 5 tokens, Bar (empty bar), Bar, 20 tokens, EOS
        assert!(tb[1..22].iter().all(|&b| b == Some(0)));
        assert_eq!(tb[22], Some(1));
        assert!(tb[23..44].iter().all(|&b| b == Some(2)));
        assert_eq!(tb[44], None, "EOS stands in no bar");
        assert_eq!(bars(&ids, &v).len(), 3, "as many bars as bars() reads");
    }

    #[test]
    fn bar_copy_distances_point_at_the_nearest_verbatim_copy() {
        let (a, b, c, x) = (200, 201, 300, 400);
        let ids = [
            BOS_ID, BAR_ID, a, b, BAR_ID, c, BAR_ID, a, b, BAR_ID, c, BAR_ID, a, b, BAR_ID, a, b, x,
        ];
        let five = Some(5);
        // BOS belongs to no bar; the first [a, b] and [c] are fresh; the bar at 11 is
        // 5 back from the one at 6, not 10 from the first; [a, b, x] is not [a, b]
        let want = [
            None, None, None, None, None, None, five, five, five, five, five, five, five, five,
            None, None, None, None,
        ];
        assert_eq!(bar_copy_distances(&ids), want);
        assert_eq!(bar_copy_distances(&[]), Vec::<Option<usize>>::new());
        assert_eq!(bar_copy_distances(&[BOS_ID, a, b]), [None; 3]);
    }

    #[test]
    fn bar_returns_tell_copies_from_fresh_bars() {
        let (a, b, c) = (motif(60), motif(70), motif(80));
        let mut a_like = a.clone();
        a_like[3].1 = 99; // 3 of 5 distinct notes shared with a: 3 / 5
        a_like.sort_unstable();
        let bars = vec![a.clone(), b.clone(), a.clone(), vec![], c, a_like, b];
        // a twice at lag 2, then b at lag 5: copies when min_lag <= the lag.
        assert_eq!(
            bar_returns(&bars, 2),
            vec![
                Some(false),
                Some(false),
                Some(true),
                None,
                Some(false),
                None,
                Some(true)
            ]
        );
        // With min_lag 3, bar 3 (a copy at lag 2 only) is neither: a near copy exists.
        assert_eq!(bar_returns(&bars, 3)[2], None);
        assert_eq!(bar_returns(&bars, 6)[6], None);
    }

    #[test]
    fn bars_read_position_pitch_duration_and_skip_drums() {
        let v = vocab();
        let id = |t: Token| v.id(t).unwrap();
        let ids = vec![
            BOS_ID,
            id(Token::Pitch(50)), // before any bar: nothing
            BAR_ID,
            id(Token::Pitch(51)), // before the bar's first Position: not a note
            id(Token::Duration(3)),
            id(Token::Position(6)),
            id(Token::Program(40)),
            id(Token::Pitch(64)),
            id(Token::Velocity(5)),
            id(Token::Duration(2)),
            id(Token::Program(128)),
            id(Token::PitchDrum(36)),
            id(Token::Velocity(5)),
            id(Token::Duration(1)),
            // the same note on another instrument is the same note
            id(Token::Program(0)),
            id(Token::Pitch(64)),
            id(Token::Velocity(9)),
            id(Token::Duration(2)),
            BAR_ID,
            BAR_ID,
            id(Token::Position(0)),
            id(Token::Pitch(60)),
            id(Token::Duration(7)), // without velocity (velocities off)
            EOS_ID,
            BAR_ID, // after EOS: ignored
        ];
        let b = bars(&ids, &v);
        assert_eq!(b, vec![vec![(6, 64, 2)], vec![], vec![(0, 60, 7)]]);
    }

    #[test]
    fn aabb_stream_returns_its_strain() {
        let v = vocab();
        // A = 8 different bars, B = 8 others; AABB = 32 bars.
        let a: Vec<Bar> = (0..8).map(|k| motif(40 + k)).collect();
        let b: Vec<Bar> = (0..8).map(|k| motif(70 + k)).collect();
        let piece: Vec<Bar> = [&a, &a, &b, &b].into_iter().flatten().cloned().collect();
        let read = bars(&stream(&v, &piece), &v);
        assert_eq!(read.len(), 32);
        assert!(close(strain_return(&read, 8), 1.0));
        let curve = similarity_curve(&read, MAX_LAG);
        assert_eq!(curve.len(), MAX_LAG);
        // L_8 pairs bar i with i + 8, i = 1..=24: A-A and B-B (16 pairs,
        // 1 each) but also the second A against the first B (8 pairs, 0).
        assert!(close(curve[7], 2.0 / 3.0), "L_8 = {:?}", curve[7]);
        // AA alone repeats at 8 bars everywhere
        let aa = similarity_curve(&read[..16], MAX_LAG);
        assert!(close(aa[7], 1.0), "L_8 of AA = {:?}", aa[7]);
        // neighbours differ (motifs a semitone apart share nothing)
        assert!(close(curve[0], 0.0));
        // L_16: bars i, i+16 over i = 1..16: A vs B: 0
        assert!(close(curve[15], 0.0));
        // L_32 has no pair
        assert_eq!(curve[31], None);
        // a piece too short for 2P bars has no strain return
        assert_eq!(strain_return(&read[..15], 8), None);
        assert_eq!(strain_return(&read, 0), None);
        // ABAB-like: B after A is not a return
        let ab: Vec<Bar> = [&a, &b].into_iter().flatten().cloned().collect();
        assert!(close(strain_return(&ab, 8), 0.0));
    }

    #[test]
    fn one_bar_loop_and_empty_bars_are_skipped() {
        let looped = vec![motif(60); 10];
        let curve = similarity_curve(&looped, MAX_LAG);
        assert!(close(curve[0], 1.0));
        assert!(close(curve[8], 1.0));
        assert_eq!(curve[10], None);
        // An empty bar between two copies: the pairs with it are skipped,
        // not counted as 0.
        let gap = vec![motif(60), vec![], motif(60), motif(61)];
        let c = similarity_curve(&gap, 4);
        assert!(close(c[0], 0.0)); // only (3, 4) is defined
        assert!(close(c[1], 1.0)); // (1, 3) defined, (2, 4) skipped
        assert!(close(c[2], 0.0)); // (1, 4)
        assert_eq!(c[3], None);
        // a strain whose return has an empty bar: the empty pair is skipped
        let mut strain = vec![motif(60), motif(62), motif(60), vec![]];
        assert!(close(strain_return(&strain, 2), 1.0));
        strain[1] = vec![];
        assert!(close(strain_return(&strain, 2), 1.0));
        strain[0] = vec![];
        assert_eq!(strain_return(&strain, 2), None);
    }

    #[test]
    fn section_recall_finds_copies_far_enough_back() {
        // 40 bars, all different, except bar 40 copies bar 2 (38 bars back)
        let mut piece: Vec<Bar> = (0..40).map(|k| motif(20 + 2 * k as u8)).collect();
        // distinct positions make every bar its own
        for (k, b) in piece.iter_mut().enumerate() {
            b[0].0 = k as u16;
            b.sort_unstable();
        }
        piece[39] = piece[1].clone();
        // W = 32: bars 33..40 (8 bars), one has a copy
        assert!(close(section_recall(&piece, 32), 1.0 / 8.0));
        // W = 16: bars 17..40 (24 bars), one copy
        assert!(close(section_recall(&piece, 16), 1.0 / 24.0));
        // W = 39 still reaches bar 2 from bar 40? bar 40 looks at 1..=1: no
        assert!(close(section_recall(&piece, 39), 0.0));
        assert!(close(section_recall(&piece, 38), 0.5)); // bars 39, 40
                                                         // a copy only 10 bars back does not count for W = 16
        let mut near = piece.clone();
        near[39] = near[29].clone();
        assert!(close(section_recall(&near, 16), 0.0));
        // empty bars are not counted; too short a piece is undefined
        let mut gaps = piece.clone();
        for b in gaps.iter_mut().skip(32).take(7) {
            b.clear();
        }
        assert!(close(section_recall(&gaps, 32), 1.0));
        assert_eq!(section_recall(&piece[..32], 32), None);
        // a half-similar bar (Jaccard 0.5 exactly) counts as a near copy
        let mut half = piece.clone();
        let mut b = piece[1].clone();
        // 4 notes, replace 1 with a new one: 3 shared of 5 = 0.6 >= 0.5
        b[3].1 = 127;
        b.sort_unstable();
        half[39] = b;
        assert!(close(section_recall(&half, 32), 1.0 / 8.0));
    }

    #[test]
    fn matrix_and_summary() {
        let piece = vec![motif(60), vec![], motif(60)];
        let m = self_similarity(&piece);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0], vec![Some(1.0), None, Some(1.0)]);
        assert_eq!(m[1], vec![None, None, None]);

        let a: Vec<Bar> = (0..8).map(|k| motif(40 + k)).collect();
        let b: Vec<Bar> = (0..8).map(|k| motif(70 + k)).collect();
        let aa: Vec<Bar> = [&a, &a].into_iter().flatten().cloned().collect();
        let ab: Vec<Bar> = [&a, &b].into_iter().flatten().cloned().collect();
        let short = a[..3].to_vec();
        let forms = vec![
            piece_form("aa.mid", &aa, 8),
            piece_form("ab.mid", &ab, 8),
            piece_form("short.mid", &short, 8),
        ];
        assert_eq!(forms[2].strain_return, None);
        assert_eq!(forms[0].section_recall[&16], None);
        let s = summarize(&forms, 8);
        assert_eq!(s.pieces, 3);
        assert_eq!(s.strain_pieces, 2);
        assert!(close(s.strain_return, 0.5));
        assert!(close(s.strain_share, 0.5));
        // L_8 defined in the two long pieces only: (1 + 0) / 2
        assert!(close(s.similarity_curve[7], 0.5));
        assert_eq!(s.similarity_pieces[7], 2);
        // L_1: 0 in every piece
        assert_eq!(s.similarity_pieces[0], 3);
        assert_eq!(s.section_recall[&32], None);
        assert_eq!(s.section_pieces[&32], 0);

        let table = markdown(&s, &summarize(&forms[..1], 8));
        assert!(table.contains("| strain return (P = 8) | 0.500 | 1.000 | 2 | 1 |"));
        assert!(table.contains("| bar similarity L_8 | 0.500 | 1.000 | 2 | 1 |"));
        assert!(table.contains("| section recall (W = 32) | - | - | 0 | 0 |"));
        let rows = piece_table(&forms);
        assert_eq!(rows.lines().count(), 2 + forms.len());
        assert!(rows.contains("| aa.mid | 16 | 0.000 | 0.000 | 0.000 | 1.000 | - | - | 1.000 |"));

        // JSON: undefined values are null, windows are keys
        let j = serde_json::to_value(&forms[2]).unwrap();
        assert!(j["strain_return"].is_null());
        assert!(j["section_recall"]["16"].is_null());
        assert_eq!(j["similarity_curve"].as_array().unwrap().len(), MAX_LAG);
    }

    #[test]
    fn bars_are_capped() {
        let v = vocab();
        let ids = vec![BAR_ID; MAX_FORM_BARS + 10];
        assert_eq!(bars(&ids, &v).len(), MAX_FORM_BARS);
    }
}
