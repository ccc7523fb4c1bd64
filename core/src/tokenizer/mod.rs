//! REMI+ tokenization: a score becomes one stream of event tokens
//! (`Bar`, `TimeSig`, `Position`, `Tempo`, `Program`, `Pitch`/`PitchDrum`,
//! `Velocity`, `Duration`) and back.
//!
//! `quantize` snaps a score to the grids of a [`RemiConfig`]; `encode` writes
//! the tokens of the quantized score; `decode` reads tokens back into exactly
//! that quantized score. The [`Grammar`] says which tokens may follow a prefix
//! (used to constrain sampling), and the [`Vocab`] file under `vocab/` fixes the
//! ids that a model was trained with.
//!
//! Two [`RemiConfig`] options make notes shorter: `program_changes` writes a
//! note's `Program` only when it differs from the previous note's program
//! (the decoder remembers the current one), and `velocities = false` leaves
//! out `Velocity` (notes decode at `default_velocity`). At their defaults
//! (off, on) they are not written to the vocabulary file, so existing
//! vocabularies keep their hash and ids.

mod config;
pub mod dataset;
pub mod fidelity;
mod grammar;
mod quantize;
mod remi;
mod vocab;

pub use config::{nearest_duration, RemiConfig};
pub use grammar::{next_types, validate, Grammar, GrammarError};
pub use quantize::{quantize, QuantizeReport};
pub use remi::{decode, encode, encode_quantized, DecodeReport};
pub use vocab::{Token, TokenType, Vocab, BAR_ID, BOS_ID, DRUMS, EOS_ID, PAD_ID, VOCAB_VERSION};

/// Ticks per quarter of decoded scores written to MIDI files.
pub const OUTPUT_TICKS_PER_QUARTER: u32 = 480;

/// A decoded score on a common MIDI resolution (480 ticks per quarter when the
/// grid divides it).
pub fn to_output_resolution(score: &crate::midi::Score) -> crate::midi::Score {
    if OUTPUT_TICKS_PER_QUARTER.is_multiple_of(score.ticks_per_quarter.max(1)) {
        score.rescaled(OUTPUT_TICKS_PER_QUARTER)
    } else {
        score.clone()
    }
}
