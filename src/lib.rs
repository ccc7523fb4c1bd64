//! `cadenza`: symbolic-music generation with a Performer (FAVOR+ causal linear
//! attention) and Stochastic Positional Encoding.
//!
//! The pipeline, one module per stage:
//! - [`midi`]: MIDI files to and from a plain [`midi::Score`];
//! - [`tokenizer`]: REMI+ tokens, the vocabulary, the grammar, token datasets;
//! - [`model`]: the Performer with SPE, parallel and recurrent;
//! - [`train`]: batches, the optimizer, checkpoints, runs;
//! - [`eval`]: what a model learned, per token type and pitch context;
//! - [`sample`]: generation and statistics of pieces;
//! - [`render`]: WAV and pictures;
//! - [`limits`]: what one input may cost (sizes, lengths, regular files only);
//! - [`serve`]: the local web studio.

mod alloc;
pub mod cli;
pub mod eval;
pub mod model;
pub mod sample;
pub mod serve;
pub mod train;

// The stages that need no libtorch live in `cadenza-core` (core/) and appear
// here under the same names.
pub use cadenza_core::{limits, midi, output, render, tokenizer, util};
