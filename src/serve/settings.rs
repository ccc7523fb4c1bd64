//! A job's settings as the page sends them, read with messages in the
//! page's words (the control's label, the range it takes), never in the
//! command line's flag names or serde's.
//!
//! Invariants: a [`JobRequest`] that [`parse`] returns has passed
//! [`JobRequest::validate`]; a seed is at most [`MAX_SEED`] (2^53 - 1, the
//! largest whole number a JavaScript number holds exactly, so the page shows
//! and sends back the seed that was used); a job without a seed gets a new
//! one ([`new_seed`]) when it is queued, and its view shows that seed.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{MAX_SAMPLES, MAX_TOKENS};

/// The largest seed: 2^53 - 1 (`Number.MAX_SAFE_INTEGER`).
pub const MAX_SEED: u64 = (1 << 53) - 1;
/// Most new bars one job may ask for.
pub const MAX_BARS: usize = 1024;

/// The settings of a job.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct JobRequest {
    /// A prompt id from `/api/prompts...`; none starts from nothing.
    pub prompt: Option<u64>,
    /// Use only the first bars of the prompt (none: all of it).
    pub prompt_bars: Option<usize>,
    /// Bars to add after the prompt (none: as many as `tokens` allow).
    pub bars: Option<usize>,
    /// Most tokens to add after the prompt.
    pub tokens: usize,
    pub temperature: f64,
    pub top_k: usize,
    pub top_p: f64,
    /// None: a new seed, drawn when the job is queued.
    pub seed: Option<u64>,
    pub num_samples: usize,
    /// Instruments the pieces may use, as `generate --programs` takes them:
    /// `prompt` (the prompt's; any without a prompt), `any`, or program
    /// numbers and `drums`, comma-separated.
    pub programs: String,
    /// A set of tunes (`generate --set`): where the model ends a tune, the next
    /// one begins.
    pub set: bool,
}

impl Default for JobRequest {
    fn default() -> Self {
        JobRequest {
            prompt: None,
            prompt_bars: Some(4),
            bars: Some(16),
            tokens: 4096,
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            seed: None,
            num_samples: 1,
            programs: "prompt".into(),
            set: false,
        }
    }
}

/// A fresh seed in `0..=MAX_SEED`.
pub fn new_seed() -> u64 {
    rand::random::<u64>() & MAX_SEED
}

/// What the page calls each setting, for messages.
fn label(field: &str) -> &'static str {
    match field {
        "prompt" => "The prompt",
        "prompt_bars" => "Prompt bars",
        "bars" => "Length (bars)",
        "tokens" => "Token limit",
        "temperature" => "Temperature",
        "top_k" => "Top-k",
        "top_p" => "Top-p",
        "seed" => "The seed",
        "num_samples" => "Variations",
        "programs" => "Instruments",
        "set" => "Set of tunes",
        _ => "This setting",
    }
}

/// The settings in these bytes (a JSON object), checked.
pub fn parse(bytes: &[u8]) -> Result<JobRequest, String> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| format!("the settings sent are not valid JSON ({e})"))?;
    let Value::Object(map) = &v else {
        return Err("the settings sent are not a JSON object".into());
    };
    for (k, x) in map {
        check_type(k, x)?;
    }
    let req: JobRequest =
        serde_json::from_value(v).map_err(|e| format!("the settings cannot be read ({e})"))?;
    req.validate()?;
    Ok(req)
}

/// A plain message when a setting has the wrong kind of value.
fn check_type(field: &str, x: &Value) -> Result<(), String> {
    let whole = |max: u64, nullable: bool| -> Result<(), String> {
        match x {
            Value::Null if nullable => Ok(()),
            Value::Number(n) if n.as_u64().is_some_and(|n| n <= max) => Ok(()),
            Value::Number(_) => Err(format!(
                "{} must be a whole number from 0 to {max} (got {})",
                label(field),
                shown(x)
            )),
            _ => Err(format!(
                "{} must be a whole number (got {})",
                label(field),
                shown(x)
            )),
        }
    };
    match field {
        "prompt" | "prompt_bars" | "bars" => whole(u64::MAX, true),
        "tokens" | "top_k" | "num_samples" => whole(u64::from(u32::MAX), false),
        "seed" => whole(MAX_SEED, true),
        "temperature" | "top_p" => match x {
            Value::Number(_) => Ok(()),
            _ => Err(format!(
                "{} must be a number (got {})",
                label(field),
                shown(x)
            )),
        },
        "programs" => match x {
            Value::String(_) => Ok(()),
            _ => Err(format!(
                "Instruments must be text such as \"prompt\", \"any\" or \"0,33,drums\" (got {})",
                shown(x)
            )),
        },
        "set" => match x {
            Value::Bool(_) => Ok(()),
            _ => Err(format!(
                "{} must be on or off (true or false; got {})",
                label(field),
                shown(x)
            )),
        },
        other => Err(format!(
            "unknown setting \"{}\" (this page sends prompt, prompt_bars, bars, tokens, \
             temperature, top_k, top_p, seed, num_samples, programs and set)",
            cadenza_core::util::excerpt(other, 40)
        )),
    }
}

fn shown(x: &Value) -> String {
    cadenza_core::util::excerpt(&x.to_string(), 40)
}

impl JobRequest {
    pub fn validate(&self) -> Result<(), String> {
        if self.tokens == 0 || self.tokens > MAX_TOKENS {
            return Err(format!(
                "Token limit must be between 1 and {MAX_TOKENS} (got {})",
                self.tokens
            ));
        }
        if self.bars.is_some_and(|b| b == 0 || b > MAX_BARS) {
            return Err(format!(
                "Length must be between 1 and {MAX_BARS} bars (got {})",
                self.bars.unwrap_or(0)
            ));
        }
        if self.num_samples == 0 || self.num_samples > MAX_SAMPLES {
            return Err(format!(
                "Variations must be between 1 and {MAX_SAMPLES} (got {})",
                self.num_samples
            ));
        }
        if self.prompt_bars == Some(0) {
            return Err("Prompt bars must be at least 1 (leave it empty to use all of it)".into());
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "Temperature must be above 0, e.g. 1 (got {})",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!(
                "Top-p must be above 0 and at most 1, e.g. 0.95 (got {})",
                self.top_p
            ));
        }
        if self.seed.is_some_and(|s| s > MAX_SEED) {
            return Err(format!(
                "The seed must be a whole number from 0 to {MAX_SEED}"
            ));
        }
        check_programs(&self.programs)?;
        // Anything the sampler refuses beyond the checks above.
        self.sample_config(None, 0)
            .validate()
            .map_err(|e| format!("{e:#}"))
    }

    /// The sampler's settings, with the instruments allowed, for a prompt
    /// of `prompt_bars` bars.
    pub fn sample_config(
        &self,
        programs: Option<Vec<u8>>,
        prompt_bars: usize,
    ) -> crate::sample::SampleConfig {
        crate::sample::SampleConfig {
            max_tokens: self.tokens,
            max_bars: self.bars.map(|b| prompt_bars + b),
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed.unwrap_or(0),
            programs,
            set: self.set,
            keep_first_instruments: crate::sample::pieces::keeps_first_instruments(&self.programs),
            ..Default::default()
        }
    }
}

/// `prompt`, `any`, or General MIDI program numbers (0-127) and `drums`,
/// comma-separated.
fn check_programs(text: &str) -> Result<(), String> {
    let text = text.trim();
    if text == "prompt" || text == "any" {
        return Ok(());
    }
    for part in text.split(',').map(str::trim) {
        let ok = part == "drums" || part.parse::<u8>().is_ok_and(|p| p < 128);
        if !ok {
            return Err(format!(
                "Instruments: \"{}\" is neither a General MIDI program number (0 to 127) \
                 nor \"drums\"; pick instruments from the list, or write \"prompt\", \"any\" \
                 or numbers such as 0,33,drums",
                cadenza_core::util::excerpt(part, 40)
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        parse(json.as_bytes()).unwrap_err()
    }

    #[test]
    fn good_settings_are_read_and_a_missing_seed_stays_unset() {
        let r = parse(br#"{"tokens": 64, "seed": 9007199254740991, "bars": 8}"#).unwrap();
        assert_eq!((r.tokens, r.seed, r.bars), (64, Some(MAX_SEED), Some(8)));
        assert_eq!(parse(b"{}").unwrap().seed, None);
        assert_eq!(parse(br#"{"seed": null}"#).unwrap().seed, None);
        assert_eq!(parse(b"{}").unwrap(), JobRequest::default());
        // A set of tunes reaches the sampler; `any` lets each tune choose its instruments.
        let set = parse(br#"{"set": true, "programs": "any"}"#).unwrap();
        let c = set.sample_config(None, 0);
        assert!(c.set && !c.keep_first_instruments);
        let c = parse(br#"{"set": true}"#).unwrap().sample_config(None, 0);
        assert!(c.set && c.keep_first_instruments);
        assert!(!JobRequest::default().sample_config(None, 0).set);
    }

    #[test]
    fn bad_settings_get_messages_in_the_page_words() {
        for (json, needle) in [
            (
                r#"{"seed": 99999999999999999999999}"#,
                "The seed must be a whole number from 0 to 9007199254740991 (got 1e+23)",
            ),
            (
                r#"{"seed": 9007199254740992}"#,
                "The seed must be a whole number from 0 to 9007199254740991",
            ),
            (r#"{"seed": -1}"#, "The seed must be a whole number from 0"),
            (r#"{"seed": 1.5}"#, "The seed must be a whole number from 0"),
            (
                r#"{"seed": "7"}"#,
                "The seed must be a whole number (got \"7\")",
            ),
            (
                r#"{"tokens": "many"}"#,
                "Token limit must be a whole number",
            ),
            (r#"{"tokens": 0}"#, "Token limit must be between 1 and 8192"),
            (r#"{"bars": 0}"#, "Length must be between 1 and 1024 bars"),
            (r#"{"temperature": 0}"#, "Temperature must be above 0"),
            (r#"{"top_p": 1.5}"#, "Top-p must be above 0 and at most 1"),
            (
                r#"{"num_samples": 99}"#,
                "Variations must be between 1 and 8",
            ),
            (
                r#"{"programs": "piano"}"#,
                "Instruments: \"piano\" is neither",
            ),
            (r#"{"programs": 3}"#, "Instruments must be text"),
            (r#"{"set": "yes"}"#, "Set of tunes must be on or off"),
            (r#"{"colour": "blue"}"#, "unknown setting \"colour\""),
            ("{not json", "not valid JSON"),
            ("[1]", "not a JSON object"),
        ] {
            let e = err(json);
            assert!(e.contains(needle), "{json}: {e}");
            assert!(!e.contains("--"), "{json}: a flag name in {e}");
            assert!(!e.contains("invalid type"), "{json}: serde's words in {e}");
        }
    }

    #[test]
    fn new_seeds_differ_and_fit_a_javascript_number() {
        let seeds: Vec<u64> = (0..64).map(|_| new_seed()).collect();
        assert!(seeds.iter().all(|&s| s <= MAX_SEED));
        let mut unique = seeds.clone();
        unique.sort_unstable();
        unique.dedup();
        assert!(unique.len() > 60, "{seeds:?}");
    }

    #[test]
    fn bars_after_the_prompt_become_the_sampler_total() {
        let r = JobRequest {
            bars: Some(8),
            seed: Some(5),
            ..Default::default()
        };
        let c = r.sample_config(None, 4);
        assert_eq!((c.max_bars, c.seed, c.max_tokens), (Some(12), 5, 4096));
        let r = JobRequest {
            bars: None,
            ..Default::default()
        };
        assert_eq!(r.sample_config(None, 4).max_bars, None);
    }
}
