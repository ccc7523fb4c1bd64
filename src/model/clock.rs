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
