//! The musical clock of [`crate::model::config::MusicalRope`]: where in musical time each
//! token stands, read from the tokens themselves, so that training windows, evaluation
//! windows and the generation recurrence all see the same coordinates.
//!
//! Invariants:
//! * A token's coordinates are the clock's after it has read that token: `BOS` and `Bar`
//!   move to the next bar at position 0, `Position_p` sets position p, every other token
//!   keeps the coordinates of the one before it (a note's pitch and duration stand at its
//!   onset).
//! * The bar index only grows (a new piece after `BOS` is a further bar, never bar 0
//!   again), so within a sequence a later token never has a smaller bar index.
//! * Only differences reach the attention (RoPE is relative), so a window may start its
//!   clock anywhere: [`ClockState::default`] is as good as the piece's true bar count.
//! * [`BarIndex`], the input of the bar embedding, is absolute instead: it counts bars
//!   from the last `BOS` and is "not known" until a window has seen one, so a window
//!   that begins inside a piece learns nothing false about where its bars stand.

use crate::model::config::{Axis, MusicalRope};

/// `BOS` in every vocabulary.
const BOS_ID: i64 = 1;
/// `Bar` in every vocabulary.
const BAR_ID: i64 = 3;

/// The clock between two tokens: the bar index and the position in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClockState {
    /// Bars begun since the clock started.
    pub bar: i64,
    /// Grid steps since the bar line.
    pub position: i64,
}

impl ClockState {
    /// Reads token `id` and returns its coordinates (see the module invariants).
    pub fn advance(&mut self, id: i64, m: &MusicalRope) -> ClockState {
        if id == BOS_ID || id == BAR_ID {
            self.bar += 1;
            self.position = 0;
        } else if (m.position_first..m.position_first + m.positions).contains(&id) {
            self.position = id - m.position_first;
        }
        *self
    }

    /// The place on the clock as one number, for SPE in musical time
    /// ([`crate::model::config::ModelConfig::musical_spe`]): grid steps since the clock
    /// started, every bar counted as `bar_steps` steps
    /// ([`crate::model::config::ModelConfig::spe_bar_steps`]). With the longest bar the
    /// grid spells it never falls within a sequence; with a shorter one, a longer bar's
    /// last steps reach past the next bar line, and only equal (bar lag, position lag)
    /// pairs are sure to give equal position lags.
    pub fn musical_position(&self, bar_steps: i64) -> i64 {
        self.bar * bar_steps + self.position
    }
}

/// Where in the form a token stands, for the bar embedding
/// ([`crate::model::config::ModelConfig::bar_embedding`]): bars begun since the last
/// `BOS`, or None before the first `BOS` a sequence has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BarIndex(pub Option<i64>);

impl BarIndex {
    /// Reads token `id` and returns its row of an `n` + 1 row bar embedding: `BOS` and
    /// what follows it up to the first `Bar` are row 0, each `Bar` moves one row on, rows
    /// past n - 1 are n - 1, and n is "not known".
    pub fn advance(&mut self, id: i64, n: i64) -> i64 {
        if id == BOS_ID {
            self.0 = Some(0);
        } else if id == BAR_ID {
            if let Some(b) = self.0.as_mut() {
                *b = b.saturating_add(1);
            }
        }
        match self.0 {
            Some(b) => b.min(n - 1),
            None => n,
        }
    }
}

/// The bar-embedding rows of every token of `ids` ([`BarIndex::advance`]), the index
/// starting from `start` and left after the last one.
pub fn bar_rows(ids: &[i64], start: &mut BarIndex, n: i64) -> Vec<i64> {
    ids.iter().map(|&id| start.advance(id, n)).collect()
}

/// The coordinates of every token of `ids`, the clock starting from `start` and left
/// after the last one.
pub fn coordinates(ids: &[i64], start: &mut ClockState, m: &MusicalRope) -> Vec<ClockState> {
    ids.iter().map(|&id| start.advance(id, m)).collect()
}

/// The angle of every rotary pair of a token at `token` (its index) standing at `at`:
/// each pair's frequency times its axis's coordinate, in f64 (positions run past 2^24).
pub fn angles(freqs: &[(Axis, f64)], token: i64, at: ClockState) -> impl Iterator<Item = f64> + '_ {
    freqs.iter().map(move |&(axis, w)| {
        let c = match axis {
            Axis::Token => token,
            Axis::Bar => at.bar,
            Axis::Position => at.position,
        };
        c as f64 * w
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope() -> MusicalRope {
        MusicalRope {
            bar_pairs: 2,
            position_pairs: 2,
            position_first: 10,
            positions: 48,
        }
    }

    #[test]
    fn bars_and_positions_follow_the_tokens() {
        let m = rope();
        // BOS, Bar, Pos_0, pitch, dur, Pos_12, pitch, Bar, Pos_6, pitch
        let ids = [1, 3, 10, 70, 90, 22, 71, 3, 16, 72];
        let mut clock = ClockState::default();
        let c = coordinates(&ids, &mut clock, &m);
        let pairs: Vec<(i64, i64)> = c.iter().map(|s| (s.bar, s.position)).collect();
        assert_eq!(
            pairs,
            [
                (1, 0),
                (2, 0),
                (2, 0),
                (2, 0),
                (2, 0),
                (2, 12),
                (2, 12),
                (3, 0),
                (3, 6),
                (3, 6)
            ]
        );
        assert_eq!(
            clock,
            ClockState {
                bar: 3,
                position: 6
            }
        );
        // a window cut anywhere sees the same differences
        let mut later = ClockState::default();
        let d = coordinates(&ids[5..], &mut later, &m);
        for (a, b) in c[5..].iter().zip(&d).skip(2) {
            assert_eq!(a.bar - c[7].bar, b.bar - d[2].bar);
            assert_eq!(a.position, b.position);
        }
    }

    #[test]
    fn the_musical_position_never_falls_and_counts_bars_as_whole_grids() {
        let m = rope();
        // Bar, Pos_47 (the last step), pitch, Bar, Pos_0, Pos_3, BOS, Pos_5
        let ids = [3, 57, 70, 3, 10, 13, 1, 15];
        let mut clock = ClockState::default();
        let at: Vec<i64> = coordinates(&ids, &mut clock, &m)
            .iter()
            .map(|c| c.musical_position(m.positions))
            .collect();
        assert_eq!(at, [48, 95, 95, 96, 96, 99, 144, 149]);
        assert!(at.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn a_shorter_spe_bar_keeps_every_lag_of_equal_bar_and_position_lags() {
        let m = rope();
        // two 4-bar strains with the same positions, the second 3 bars after the first
        let strain = [3, 10, 70, 22, 71, 3, 16, 72, 3, 10, 3, 34, 57];
        let mut ids = strain.to_vec();
        ids.extend([3, 3, 3]);
        ids.extend(strain);
        let c = coordinates(&ids, &mut ClockState::default(), &m);
        let n = strain.len();
        for span in [12, 48, m.positions] {
            let at: Vec<i64> = c.iter().map(|c| c.musical_position(span)).collect();
            let lags: Vec<i64> = (0..n).map(|i| at[n + 3 + i] - at[i]).collect();
            // every token of the second strain is 7 bars on from its twin
            assert!(lags.iter().all(|&l| l == 7 * span), "{span}: {lags:?}");
        }
        // a 12-step bar: Position_47 of bar 4 lands past the line of bar 5
        let at: Vec<i64> = c.iter().map(|c| c.musical_position(12)).collect();
        assert_eq!((at[n - 1], at[n]), (4 * 12 + 47, 5 * 12));
    }

    #[test]
    fn ids_outside_the_position_range_do_not_move_the_clock() {
        let m = rope();
        let mut c = ClockState {
            bar: 5,
            position: 7,
        };
        assert_eq!(
            c.advance(9, &m),
            ClockState {
                bar: 5,
                position: 7
            }
        );
        assert_eq!(
            c.advance(58, &m),
            ClockState {
                bar: 5,
                position: 7
            }
        );
        assert_eq!(
            c.advance(57, &m),
            ClockState {
                bar: 5,
                position: 47
            }
        );
    }

    #[test]
    fn bar_rows_count_from_bos_and_are_unknown_before_it() {
        // a window that begins inside a piece: Pos, pitch, Bar, pitch | BOS, Tempo, Bar,
        // Pos, pitch, Bar, Bar, Bar, Bar
        let ids = [10, 70, 3, 71, 1, 5, 3, 10, 72, 3, 3, 3, 3];
        let mut at = BarIndex::default();
        let rows = bar_rows(&ids, &mut at, 3);
        assert_eq!(rows, [3, 3, 3, 3, 0, 0, 1, 1, 1, 2, 2, 2, 2]);
        assert_eq!(at, BarIndex(Some(5)), "the count goes on past the last row");
        // cut anywhere after the BOS, a window carrying the index sees the same rows
        let mut carried = BarIndex(Some(1));
        assert_eq!(bar_rows(&ids[7..], &mut carried, 3), rows[7..]);
        // a second piece starts again at row 0
        assert_eq!(at.advance(1, 3), 0);
    }

    #[test]
    fn angles_take_each_pair_on_its_axis() {
        let f = [(Axis::Token, 1.0), (Axis::Bar, 0.5), (Axis::Position, 0.25)];
        let a: Vec<f64> = angles(
            &f,
            100,
            ClockState {
                bar: 4,
                position: 8,
            },
        )
        .collect();
        assert_eq!(a, [100.0, 2.0, 2.0]);
    }
}
