//! MIDI files in and out, through `midly`, and the plain [`Score`] they become.

mod read;
mod score;
mod write;

pub use read::{
    parse, parse_named, parse_named_with, parse_with, read_file, read_file_with, Limits, MidiError,
    ReadReport, SMPTE_TICKS_PER_QUARTER,
};
pub use score::{
    clean_name, InstrumentName, KeySignature, Note, Score, TempoChange, TimeSignature,
    DEFAULT_US_PER_QUARTER, MAX_NAME_BYTES,
};
pub use write::{to_bytes, write_file, MAX_VOICES};
