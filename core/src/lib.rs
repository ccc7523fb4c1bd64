//! `cadenza-core`: the stages of cadenza that need no model, without libtorch.
//!
//! - [`midi`]: MIDI files to and from a plain [`midi::Score`];
//! - [`tokenizer`]: REMI+ tokens, the vocabulary, the grammar, token datasets;
//! - [`render`]: WAV rendering with a SoundFont, piano rolls and plots;
//! - [`commands`]: the model-free commands (encode, decode, inspect, tokenize,
//!   vocab), their clap arguments and what they run;
//! - [`util`]: atomic file writes, bounded excerpts of input for messages;
//! - [`output`]: the output policy (what a command may write over);
//! - [`limits`]: what one input may cost (sizes, lengths, regular files only).
//!
//! Other Rust programs can read, tokenize and render music with this crate
//! alone; the `cadenza` crate re-exports these modules under the same names,
//! next to the model, training and sampling that need libtorch. The
//! `cadenza` command runs its model-free commands from this crate only, so
//! they start in milliseconds instead of paying for loading libtorch.

pub mod commands;
pub mod limits;
pub mod midi;
pub mod output;
pub mod render;
pub mod tokenizer;
pub mod util;
