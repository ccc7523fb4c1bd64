//! `cadenza-core`: the stages of cadenza that need no model, without libtorch.
//!
//! - [`midi`]: MIDI files to and from a plain [`midi::Score`];
//! - [`tokenizer`]: REMI+ tokens, the vocabulary, the grammar, token datasets;
//! - [`render`]: WAV rendering with a SoundFont, piano rolls and plots;
//! - [`util`]: atomic file writes.
//!
//! Other Rust programs can read, tokenize and render music with this crate
//! alone; the `cadenza` crate re-exports these modules under the same names,
//! next to the model, training and sampling that need libtorch. The
//! `cadenza` command runs its model-free commands (encode, decode, inspect,
//! tokenize, vocab) from this crate only, so they start in milliseconds
//! instead of paying for loading libtorch.
//!
//! The sources stay in the main crate's `src/` folders, one per stage, so
//! that the pipeline reads in one place; they are compiled here and only here.

#[path = "../../src/midi/mod.rs"]
pub mod midi;
#[path = "../../src/render/mod.rs"]
pub mod render;
#[path = "../../src/tokenizer/mod.rs"]
pub mod tokenizer;
#[path = "../../src/util.rs"]
pub mod util;
