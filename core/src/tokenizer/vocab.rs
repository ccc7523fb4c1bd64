//! Token kinds, their ids, and the vocabulary file under `vocab/`.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::config::RemiConfig;

/// Version of the token layout; bump when the meaning of ids changes.
pub const VOCAB_VERSION: u32 = 1;

/// The instrument a `Program` token announces; `DRUMS` is the drum kit.
pub const DRUMS: u8 = 128;

/// One REMI+ event. Values are bins or indices into the config's grids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Token {
    Pad,
    Bos,
    Eos,
    Bar,
    TimeSig {
        numerator: u8,
        denominator: u8,
    },
    Position(u16),
    Tempo(u16),
    /// 0..=127, or [`DRUMS`].
    Program(u8),
    Pitch(u8),
    PitchDrum(u8),
    Velocity(u8),
    /// Index into [`RemiConfig::durations`].
    Duration(u16),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum TokenType {
    Pad,
    Bos,
    Eos,
    Bar,
    TimeSig,
    Position,
    Tempo,
    Program,
    Pitch,
    PitchDrum,
    Velocity,
    Duration,
}

impl Token {
    pub fn kind(&self) -> TokenType {
        match self {
            Token::Pad => TokenType::Pad,
            Token::Bos => TokenType::Bos,
            Token::Eos => TokenType::Eos,
            Token::Bar => TokenType::Bar,
            Token::TimeSig { .. } => TokenType::TimeSig,
            Token::Position(_) => TokenType::Position,
            Token::Tempo(_) => TokenType::Tempo,
            Token::Program(_) => TokenType::Program,
            Token::Pitch(_) => TokenType::Pitch,
            Token::PitchDrum(_) => TokenType::PitchDrum,
            Token::Velocity(_) => TokenType::Velocity,
            Token::Duration(_) => TokenType::Duration,
        }
    }
}

impl fmt::Display for TokenType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// The id layout: one contiguous block of ids per token type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    time_sig: u32,
    position: u32,
    tempo: u32,
    program: u32,
    pitch: u32,
    pitch_drum: u32,
    velocity: u32,
    duration: u32,
    end: u32,
}

pub const PAD_ID: u32 = 0;
pub const BOS_ID: u32 = 1;
pub const EOS_ID: u32 = 2;
pub const BAR_ID: u32 = 3;

/// A vocabulary: the config, every token's string, and a content hash that
/// checkpoints and datasets record.
#[derive(Debug, Clone)]
pub struct Vocab {
    config: RemiConfig,
    layout: Layout,
    time_sigs: Vec<(u8, u8)>,
    durations: Vec<u32>,
    tempos: Vec<f64>,
    strings: Vec<String>,
    by_string: HashMap<String, u32>,
    hash: String,
}

/// The vocabulary file. Every key is required and an unknown one is refused
/// (every vocabulary written so far, `vocab/*.json` included, has exactly
/// these five).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct VocabFile {
    version: u32,
    hash: String,
    size: usize,
    config: RemiConfig,
    tokens: Vec<String>,
}

impl Vocab {
    pub fn new(config: RemiConfig) -> Result<Vocab> {
        config.validate().context("invalid tokenizer config")?;
        let mut time_sigs = Vec::new();
        let mut dens = config.denominators.clone();
        dens.sort();
        for &den in &dens {
            for num in 1..=config.max_numerator {
                if config.is_supported_time_signature(num, den) {
                    time_sigs.push((num, den));
                }
            }
        }
        let durations = config.durations();
        let tempos = config.tempos();
        let n_pos = config.max_bar_steps();
        let time_sig = BAR_ID + 1;
        let position = time_sig + time_sigs.len() as u32;
        let tempo = position + n_pos;
        let program = tempo + tempos.len() as u32;
        let pitch = program + 129;
        let pitch_drum = pitch + (config.pitch_max - config.pitch_min) as u32 + 1;
        let velocity = pitch_drum + (config.drum_pitch_max - config.drum_pitch_min) as u32 + 1;
        let velocity_tokens = if config.velocities {
            config.velocity_bins
        } else {
            0
        };
        let duration = velocity + velocity_tokens;
        let end = duration + durations.len() as u32;
        if end > u16::MAX as u32 {
            bail!("vocabulary of {end} tokens does not fit u16 ids");
        }
        let layout = Layout {
            time_sig,
            position,
            tempo,
            program,
            pitch,
            pitch_drum,
            velocity,
            duration,
            end,
        };
        let mut v = Vocab {
            config,
            layout,
            time_sigs,
            durations,
            tempos,
            strings: Vec::new(),
            by_string: HashMap::new(),
            hash: String::new(),
        };
        v.strings = (0..end)
            .map(|id| v.token_string(v.token(id).expect("id within layout")))
            .collect();
        v.by_string = v
            .strings
            .iter()
            .enumerate()
            .map(|(i, s)| (s.clone(), i as u32))
            .collect();
        let mut h = Sha256::new();
        h.update(VOCAB_VERSION.to_le_bytes());
        h.update(serde_json::to_vec(&v.config).expect("config serializes"));
        for s in &v.strings {
            h.update(s.as_bytes());
            h.update([0u8]);
        }
        v.hash = h
            .finalize()
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(v)
    }

    pub fn config(&self) -> &RemiConfig {
        &self.config
    }
    pub fn len(&self) -> usize {
        self.layout.end as usize
    }
    pub fn is_empty(&self) -> bool {
        self.layout.end == 0
    }
    /// Content hash (hex): equal hashes mean identical ids and meanings.
    pub fn hash(&self) -> &str {
        &self.hash
    }
    pub fn durations(&self) -> &[u32] {
        &self.durations
    }
    pub fn time_signatures(&self) -> &[(u8, u8)] {
        &self.time_sigs
    }
    pub fn num_tempos(&self) -> usize {
        self.tempos.len()
    }

    pub fn id(&self, t: Token) -> Option<u32> {
        let l = &self.layout;
        let c = &self.config;
        let in_range = |base: u32, v: u32, n: u32| (v < n).then_some(base + v);
        match t {
            Token::Pad => Some(PAD_ID),
            Token::Bos => Some(BOS_ID),
            Token::Eos => Some(EOS_ID),
            Token::Bar => Some(BAR_ID),
            Token::TimeSig {
                numerator,
                denominator,
            } => self
                .time_sigs
                .iter()
                .position(|&x| x == (numerator, denominator))
                .map(|i| l.time_sig + i as u32),
            Token::Position(p) => in_range(l.position, p as u32, l.tempo - l.position),
            Token::Tempo(b) => in_range(l.tempo, b as u32, l.program - l.tempo),
            Token::Program(p) => in_range(l.program, p as u32, 129),
            Token::Pitch(p) => {
                (p >= c.pitch_min && p <= c.pitch_max).then(|| l.pitch + (p - c.pitch_min) as u32)
            }
            Token::PitchDrum(p) => (p >= c.drum_pitch_min && p <= c.drum_pitch_max)
                .then(|| l.pitch_drum + (p - c.drum_pitch_min) as u32),
            Token::Velocity(b) => in_range(l.velocity, b as u32, l.duration - l.velocity),
            Token::Duration(i) => in_range(l.duration, i as u32, l.end - l.duration),
        }
    }

    pub fn token(&self, id: u32) -> Option<Token> {
        let l = &self.layout;
        let c = &self.config;
        Some(match id {
            PAD_ID => Token::Pad,
            BOS_ID => Token::Bos,
            EOS_ID => Token::Eos,
            BAR_ID => Token::Bar,
            i if i < l.position => {
                let (numerator, denominator) = self.time_sigs[(i - l.time_sig) as usize];
                Token::TimeSig {
                    numerator,
                    denominator,
                }
            }
            i if i < l.tempo => Token::Position((i - l.position) as u16),
            i if i < l.program => Token::Tempo((i - l.tempo) as u16),
            i if i < l.pitch => Token::Program((i - l.program) as u8),
            i if i < l.pitch_drum => Token::Pitch(c.pitch_min + (i - l.pitch) as u8),
            i if i < l.velocity => Token::PitchDrum(c.drum_pitch_min + (i - l.pitch_drum) as u8),
            i if i < l.duration => Token::Velocity((i - l.velocity) as u8),
            i if i < l.end => Token::Duration((i - l.duration) as u16),
            _ => return None,
        })
    }

    /// The type of an id without building the token.
    pub fn kind(&self, id: u32) -> Option<TokenType> {
        self.token(id).map(|t| t.kind())
    }

    /// The contiguous id range of a token type.
    pub fn range(&self, kind: TokenType) -> std::ops::Range<u32> {
        let l = &self.layout;
        match kind {
            TokenType::Pad => PAD_ID..PAD_ID + 1,
            TokenType::Bos => BOS_ID..BOS_ID + 1,
            TokenType::Eos => EOS_ID..EOS_ID + 1,
            TokenType::Bar => BAR_ID..BAR_ID + 1,
            TokenType::TimeSig => l.time_sig..l.position,
            TokenType::Position => l.position..l.tempo,
            TokenType::Tempo => l.tempo..l.program,
            TokenType::Program => l.program..l.pitch,
            TokenType::Pitch => l.pitch..l.pitch_drum,
            TokenType::PitchDrum => l.pitch_drum..l.velocity,
            TokenType::Velocity => l.velocity..l.duration,
            TokenType::Duration => l.duration..l.end,
        }
    }

    pub fn string(&self, id: u32) -> Option<&str> {
        self.strings.get(id as usize).map(String::as_str)
    }

    pub fn parse_token(&self, s: &str) -> Option<u32> {
        self.by_string.get(s).copied()
    }

    fn token_string(&self, t: Token) -> String {
        match t {
            Token::Pad => "PAD".into(),
            Token::Bos => "BOS".into(),
            Token::Eos => "EOS".into(),
            Token::Bar => "Bar".into(),
            Token::TimeSig {
                numerator,
                denominator,
            } => format!("TimeSig_{numerator}/{denominator}"),
            Token::Position(p) => format!("Position_{p}"),
            Token::Tempo(b) => format!("Tempo_{:.2}", self.tempos[b as usize]),
            Token::Program(DRUMS) => "Program_Drums".into(),
            Token::Program(p) => format!("Program_{p}"),
            Token::Pitch(p) => format!("Pitch_{p}"),
            Token::PitchDrum(p) => format!("PitchDrum_{p}"),
            Token::Velocity(b) => format!("Velocity_{}", self.config.velocity_value(b)),
            Token::Duration(i) => format!("Duration_{}", self.durations[i as usize]),
        }
    }

    /// Writes the vocabulary as JSON (strings, ids by position, config, version, hash).
    pub fn save(&self, path: &Path) -> Result<()> {
        // a vocabulary is only built from a valid config; checked again so
        // that nothing out of range (a `null` for an infinity) is ever written
        self.config
            .validate()
            .with_context(|| format!("{}: not written", path.display()))?;
        let file = VocabFile {
            version: VOCAB_VERSION,
            hash: self.hash.clone(),
            size: self.len(),
            config: self.config.clone(),
            tokens: self.strings.clone(),
        };
        crate::util::write_json(path, &file)
    }

    /// Loads a vocabulary file and checks that it is what its config builds.
    pub fn load(path: &Path) -> Result<Vocab> {
        let text = crate::limits::read_text(path, crate::limits::MAX_CONFIG_BYTES)
            .with_context(|| format!("cannot read vocabulary {}", path.display()))?;
        let file: VocabFile = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a cadenza vocabulary file", path.display()))?;
        if file.version != VOCAB_VERSION {
            bail!(
                "{}: vocabulary version {} but this cadenza reads version {VOCAB_VERSION}",
                path.display(),
                file.version
            );
        }
        if file.size != file.tokens.len() {
            bail!(
                "{}: size says {} tokens but the token list holds {}",
                path.display(),
                file.size,
                file.tokens.len()
            );
        }
        let v = Vocab::new(file.config)
            .with_context(|| format!("{}: bad tokenizer config", path.display()))?;
        if v.len() != file.size {
            bail!(
                "{}: size says {} tokens but its config builds {}",
                path.display(),
                file.size,
                v.len()
            );
        }
        if v.strings != file.tokens || v.hash != file.hash {
            bail!(
                "{}: token list or hash does not match its config (file edited or from another version)",
                path.display()
            );
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_tokens_are_inverse() {
        for (program_changes, velocities) in [(false, true), (true, true), (false, false)] {
            let v = Vocab::new(RemiConfig {
                program_changes,
                velocities,
                ..RemiConfig::default()
            })
            .unwrap();
            for id in 0..v.len() as u32 {
                let t = v.token(id).unwrap();
                assert_eq!(v.id(t), Some(id), "{t:?}");
                assert_eq!(v.parse_token(v.string(id).unwrap()), Some(id));
                assert!(v.range(t.kind()).contains(&id));
            }
            assert_eq!(v.token(v.len() as u32), None);
            assert_eq!(v.id(Token::Pitch(20)), None);
            assert_eq!(v.id(Token::Position(288)), None);
            assert_eq!(v.id(Token::Velocity(0)).is_some(), velocities);
        }
    }

    #[test]
    fn save_load_round_trip_and_tamper_detection() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("v.json");
        let v = Vocab::new(RemiConfig::default()).unwrap();
        v.save(&p).unwrap();
        let w = Vocab::load(&p).unwrap();
        assert_eq!(v.hash(), w.hash());
        let text = std::fs::read_to_string(&p)
            .unwrap()
            .replace("\"Pitch_60\"", "\"Pitch_6O\"");
        std::fs::write(&p, text).unwrap();
        let err = Vocab::load(&p).unwrap_err().to_string();
        assert!(err.contains("v.json"), "{err}");
    }

    #[test]
    fn size_and_unknown_keys_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("v.json");
        Vocab::new(RemiConfig::default()).unwrap().save(&p).unwrap();
        let good: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        let mut bad = good.clone();
        bad["size"] = serde_json::json!(876);
        std::fs::write(&p, bad.to_string()).unwrap();
        let e = format!("{:#}", Vocab::load(&p).unwrap_err());
        assert!(
            e.contains("v.json") && e.contains("876") && e.contains("877"),
            "{e}"
        );
        let mut bad = good.clone();
        bad["sise"] = serde_json::json!(877);
        std::fs::write(&p, bad.to_string()).unwrap();
        let e = format!("{:#}", Vocab::load(&p).unwrap_err());
        assert!(e.contains("sise"), "{e}");
        let mut bad = good;
        bad["config"]["tempo_ratios"] = serde_json::json!(1.1);
        std::fs::write(&p, bad.to_string()).unwrap();
        let e = format!("{:#}", Vocab::load(&p).unwrap_err());
        assert!(e.contains("tempo_ratios"), "{e}");
    }

    #[test]
    fn shipped_vocabularies_load() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../vocab");
        let mut n = 0;
        for f in std::fs::read_dir(&root).unwrap() {
            let p = f.unwrap().path();
            if p.extension().is_some_and(|e| e == "json") {
                Vocab::load(&p).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
                n += 1;
            }
        }
        assert!(n >= 3, "{n} vocabularies under {}", root.display());
    }

    #[test]
    fn config_changes_change_the_hash() {
        let a = Vocab::new(RemiConfig::default()).unwrap();
        let b = Vocab::new(RemiConfig {
            velocity_bins: 64,
            ..RemiConfig::default()
        })
        .unwrap();
        assert_ne!(a.hash(), b.hash());
    }
}
