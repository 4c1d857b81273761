//! What a request costs, counted before the call as the provider will count it.
//!
//! Providers bill, and rate-limit, by the tokens of their own encoding. The gateway must
//! know a request's tokens *before* it sends it, to charge the tenant's tokens-per-minute
//! and the upstream account's mirror, and that count must never be below the provider's:
//! a mirror that under-charges lets through a request the real account answers with
//! `429`. An over-count costs little, since every request settles to the `usage` the
//! provider reports once the answer is in, but it holds capacity back until then.
//!
//! So each served model names its [`Encoding`], and the gateway counts with it:
//!
//! - [`Encoding::Cl100kBase`] and [`Encoding::O200kBase`] are OpenAI's byte-pair
//!   encodings, counted exactly by the `bpe-openai` crate, whose tables are compiled
//!   into the binary (nothing is downloaded at run time). `cl100k_base` serves the
//!   `text-embedding-3-*` and `ada-002` embedding models, GPT-4 and GPT-3.5;
//!   `o200k_base` serves GPT-4o, GPT-4.1, GPT-5 and the o-series.
//!   [`Encoding::for_model`] knows those names, so their encoding need not be
//!   configured.
//! - [`Encoding::Utf8Bytes`] counts one token per byte of UTF-8: an upper bound for
//!   every byte-level BPE (each of their tokens stands for at least one byte), for a
//!   model whose encoding is not built in. It over-charges English text about four
//!   times until each request settles; the configuration must choose it by name.
//!
//! Counting stops at a limit ([`Encoding::count_within`]): a request with more tokens
//! than the gateway accepts costs the work of counting up to the limit, not of its
//! whole body.
//!
//! # What a request is charged
//!
//! - **Embeddings:** the sum over the inputs of each text's tokens, one token per id for
//!   token-id inputs: what the provider bills, exactly.
//! - **Chat completions:** every message costs its role's and its content's tokens and
//!   [`MESSAGE_OVERHEAD`] more (the tokens that frame a message), a message's `name`
//!   its tokens and [`NAME_OVERHEAD`], and the prompt [`REPLY_PRIMING`] for the start of
//!   the answer: the formula OpenAI publishes for its chat models. Tool calls are
//!   counted as the tokens of their JSON text, which is longer than the form the model
//!   sees. An image part costs what its size and the model make it, and the gateway does
//!   not fetch the image: each is charged [`ModelEncodings::image_tokens`]
//!   (`gateway.image_tokens`, by default 1,445, the most one image costs GPT-4o at high
//!   detail; GPT-4o-mini bills up to 48,169), then settled to the reported usage.
//!   The completion is reserved on top: `max_completion_tokens` (or `max_tokens`) when
//!   the request gives it, or else the gateway's configured default.
//!
//! ```
//! use embedding_gateway::tokenizer::Encoding;
//!
//! let cl100k = Encoding::Cl100kBase;
//! assert_eq!(cl100k.count("Hello, world!"), 4);
//! assert_eq!(cl100k.count_within("Hello, world!", 3), None);
//! assert_eq!(Encoding::Utf8Bytes.count("naïve"), 6);
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// Tokens that frame each chat message (its start, role separator and end), on top of
/// its role's and content's tokens.
pub const MESSAGE_OVERHEAD: u64 = 3;

/// Tokens a message's `name` costs on top of its own.
pub const NAME_OVERHEAD: u64 = 1;

/// Tokens that prime the answer of a chat completion, once per request.
pub const REPLY_PRIMING: u64 = 3;

/// How a model's text is cut into tokens.
///
/// ```
/// use embedding_gateway::tokenizer::Encoding;
///
/// let e: Encoding = "o200k_base".parse().unwrap();
/// assert_eq!(e, Encoding::O200kBase);
/// assert_eq!(e.name(), "o200k_base");
/// assert!(e.is_exact());
/// assert!("p50k_base".parse::<Encoding>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// OpenAI's `cl100k_base`: `text-embedding-3-*`, `text-embedding-ada-002`, GPT-4,
    /// GPT-3.5.
    Cl100kBase,
    /// OpenAI's `o200k_base`: GPT-4o, GPT-4.1, GPT-4.5, GPT-5, o1, o3, o4.
    O200kBase,
    /// One token per byte of UTF-8 (`utf8_bytes`): an upper bound of every byte-level
    /// BPE, for models whose encoding is not built in.
    Utf8Bytes,
}

/// The encoding names a configuration may give.
pub const ENCODING_NAMES: [&str; 3] = ["cl100k_base", "o200k_base", "utf8_bytes"];

/// Model name prefixes whose encoding is known, most specific first.
const KNOWN_MODELS: [(&str, Encoding); 13] = [
    ("text-embedding-3-", Encoding::Cl100kBase),
    ("text-embedding-ada-002", Encoding::Cl100kBase),
    ("gpt-4o", Encoding::O200kBase),
    ("chatgpt-4o", Encoding::O200kBase),
    ("gpt-4.1", Encoding::O200kBase),
    ("gpt-4.5", Encoding::O200kBase),
    ("gpt-5", Encoding::O200kBase),
    ("o1", Encoding::O200kBase),
    ("o3", Encoding::O200kBase),
    ("o4", Encoding::O200kBase),
    ("gpt-4", Encoding::Cl100kBase),
    ("gpt-3.5-turbo", Encoding::Cl100kBase),
    ("gpt-35-turbo", Encoding::Cl100kBase),
];

impl Encoding {
    /// The encoding of one of OpenAI's models, by its name or a dated version of it
    /// (`gpt-4o-2024-08-06`); `None` for a model this table does not know.
    ///
    /// ```
    /// use embedding_gateway::tokenizer::Encoding;
    ///
    /// assert_eq!(Encoding::for_model("text-embedding-3-small"), Some(Encoding::Cl100kBase));
    /// assert_eq!(Encoding::for_model("gpt-4o-mini"), Some(Encoding::O200kBase));
    /// assert_eq!(Encoding::for_model("gpt-4-turbo"), Some(Encoding::Cl100kBase));
    /// assert_eq!(Encoding::for_model("nomic-embed-text"), None);
    /// ```
    #[must_use]
    pub fn for_model(model: &str) -> Option<Encoding> {
        KNOWN_MODELS.iter().find(|(prefix, _)| model.starts_with(prefix)).map(|&(_, e)| e)
    }

    /// The name configurations use (`cl100k_base`, `o200k_base`, `utf8_bytes`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Encoding::Cl100kBase => ENCODING_NAMES[0],
            Encoding::O200kBase => ENCODING_NAMES[1],
            Encoding::Utf8Bytes => ENCODING_NAMES[2],
        }
    }

    /// Whether counts are the provider's own (`false`: an upper bound).
    #[must_use]
    pub fn is_exact(self) -> bool {
        self != Encoding::Utf8Bytes
    }

    /// Builds the encoding's tables now rather than on the first request that needs them
    /// (some 100 ms for a BPE).
    pub fn load(self) {
        let _ = self.bpe();
    }

    fn bpe(self) -> Option<&'static bpe_openai::Tokenizer> {
        match self {
            Encoding::Cl100kBase => Some(bpe_openai::cl100k_base()),
            Encoding::O200kBase => Some(bpe_openai::o200k_base()),
            Encoding::Utf8Bytes => None,
        }
    }

    /// The tokens of `text`.
    ///
    /// ```
    /// use embedding_gateway::tokenizer::Encoding;
    ///
    /// assert_eq!(Encoding::Cl100kBase.count("rate limits"), 2);
    /// assert_eq!(Encoding::Cl100kBase.count(""), 0);
    /// ```
    #[must_use]
    pub fn count(self, text: &str) -> u64 {
        match self.bpe() {
            Some(bpe) => bpe.count(text) as u64,
            None => text.len() as u64,
        }
    }

    /// The tokens of `text` if there are at most `limit`, else `None`: counting stops
    /// about where the limit is passed, so a long text costs the work of `limit` tokens.
    ///
    /// ```
    /// use embedding_gateway::tokenizer::Encoding;
    ///
    /// let e = Encoding::Cl100kBase;
    /// assert_eq!(e.count_within("Hello, world!", 4), Some(4));
    /// assert_eq!(e.count_within(&"word ".repeat(1_000_000), 10), None);
    /// ```
    #[must_use]
    pub fn count_within(self, text: &str, limit: u64) -> Option<u64> {
        match self.bpe() {
            Some(bpe) => {
                // Each token stands for at least one byte.
                if text.len() as u64 <= limit {
                    return Some(bpe.count(text) as u64).filter(|&n| n <= limit);
                }
                let limit = usize::try_from(limit).unwrap_or(usize::MAX);
                bpe.count_till_limit(&bpe.normalize(text), limit).map(|n| n as u64)
            }
            None => Some(text.len() as u64).filter(|&n| n <= limit),
        }
    }
}

impl fmt::Display for Encoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An encoding name that is none of [`ENCODING_NAMES`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownEncoding(pub String);

impl fmt::Display for UnknownEncoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown encoding {:?}: one of {}", self.0, ENCODING_NAMES.join(", "))
    }
}

impl std::error::Error for UnknownEncoding {}

impl FromStr for Encoding {
    type Err = UnknownEncoding;

    fn from_str(s: &str) -> Result<Self, UnknownEncoding> {
        match s {
            "cl100k_base" => Ok(Encoding::Cl100kBase),
            "o200k_base" => Ok(Encoding::O200kBase),
            "utf8_bytes" => Ok(Encoding::Utf8Bytes),
            other => Err(UnknownEncoding(other.to_owned())),
        }
    }
}

/// The encoding of every served model, shared by the gateway's stages and the mock
/// provider.
///
/// ```
/// use embedding_gateway::tokenizer::{Encoding, ModelEncodings};
///
/// let models = ModelEncodings::new([("text-embedding-3-small".to_owned(), Encoding::Cl100kBase)]);
/// assert_eq!(models.get("text-embedding-3-small"), Some(Encoding::Cl100kBase));
/// assert_eq!(models.get("other"), None);
/// ```
#[derive(Debug, Clone)]
pub struct ModelEncodings {
    models: Arc<BTreeMap<String, Encoding>>,
    image_tokens: u64,
}

/// What one image of a chat message is charged unless configured:
/// the most one image costs GPT-4o at high detail (85 + 170 for each of 8 tiles).
pub const DEFAULT_IMAGE_TOKENS: u64 = 1_445;

impl Default for ModelEncodings {
    fn default() -> Self {
        ModelEncodings { models: Arc::default(), image_tokens: DEFAULT_IMAGE_TOKENS }
    }
}

impl ModelEncodings {
    /// From each model's name and encoding; images charged [`DEFAULT_IMAGE_TOKENS`].
    pub fn new(models: impl IntoIterator<Item = (String, Encoding)>) -> Self {
        ModelEncodings { models: Arc::new(models.into_iter().collect()), image_tokens: DEFAULT_IMAGE_TOKENS }
    }

    /// Each image of a chat message charged `tokens`.
    ///
    /// ```
    /// use embedding_gateway::tokenizer::{DEFAULT_IMAGE_TOKENS, ModelEncodings};
    ///
    /// assert_eq!(ModelEncodings::default().image_tokens(), DEFAULT_IMAGE_TOKENS);
    /// assert_eq!(ModelEncodings::default().with_image_tokens(765).image_tokens(), 765);
    /// ```
    #[must_use]
    pub fn with_image_tokens(mut self, tokens: u64) -> Self {
        self.image_tokens = tokens;
        self
    }

    /// What each image of a chat message is charged.
    #[must_use]
    pub fn image_tokens(&self) -> u64 {
        self.image_tokens
    }

    /// The encoding of `model`, if it is one of these.
    #[must_use]
    pub fn get(&self, model: &str) -> Option<Encoding> {
        self.models.get(model).copied()
    }

    /// Every model and its encoding, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Encoding)> {
        self.models.iter().map(|(m, e)| (m.as_str(), *e))
    }

    /// Builds every encoding's tables now (see [`Encoding::load`]).
    pub fn load(&self) {
        for (_, e) in self.iter() {
            e.load();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_stop_at_the_limit_and_not_before() {
        let e = Encoding::Cl100kBase;
        let text = "The quick brown fox jumps over the lazy dog. ".repeat(50);
        let n = e.count(&text);
        assert!(n > 100, "{n}");
        assert_eq!(e.count_within(&text, n), Some(n));
        assert_eq!(e.count_within(&text, n - 1), None);
        assert_eq!(Encoding::Utf8Bytes.count_within("abcd", 4), Some(4));
        assert_eq!(Encoding::Utf8Bytes.count_within("abcd", 3), None);
    }

    #[test]
    fn every_name_parses_back() {
        for name in ENCODING_NAMES {
            assert_eq!(name.parse::<Encoding>().map(Encoding::name), Ok(name));
        }
        assert_eq!(Encoding::for_model("o3-mini"), Some(Encoding::O200kBase));
        assert_eq!(Encoding::for_model("gpt-3.5-turbo-0125"), Some(Encoding::Cl100kBase));
        assert!(!Encoding::Utf8Bytes.is_exact());
    }
}
