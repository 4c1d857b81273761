//! Limits as data: serde types for limits and limit sets, loadable from TOML and JSON.
//!
//! A policy is plain data; [`LimitSet::new`](crate::LimitSet::new) validates it and
//! returns a [`PolicyError`] that names the offending field when something is wrong
//! (`limits[2] (tokens-per-minute).burst: must be at least 1`). The same policy can
//! replace a running set's policy with
//! [`LimitSet::replace_policy`](crate::LimitSet::replace_policy), keeping the state of
//! every key already tracked by limits that kept their name, algorithm and scope.
//!
//! ```
//! use tower_limits_core::LimitSetPolicy;
//!
//! let policy = LimitSetPolicy::from_toml(r#"
//!     tiers = ["org", "team", "user"]
//!
//!     [[limit]]
//!     name = "requests-per-minute"
//!     scope = "user"
//!     algorithm = "gcra"
//!     rate = "600/1m"
//!     burst = 20
//!
//!     [[limit]]
//!     name = "tokens-per-minute"
//!     scope = "org"
//!     counts = "cost"
//!     algorithm = "token_bucket"
//!     rate = "1000000/1m"
//!     burst = 100000
//!
//!     [[limit]]
//!     name = "concurrent"
//!     scope = "user"
//!     algorithm = "semaphore"
//!     capacity = 4
//! "#).unwrap();
//! assert_eq!(policy.limits.len(), 3);
//! policy.validate().unwrap();
//! ```

use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::rate::Rate;

/// A policy that does not make sense, with the field that says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    field: String,
    message: String,
}

impl PolicyError {
    /// An error about `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        PolicyError { field: field.into(), message: message.into() }
    }

    /// The path of the offending field, such as `limits[2] (tokens-per-minute).burst`.
    #[must_use]
    pub fn field(&self) -> &str {
        &self.field
    }

    /// What is wrong with it.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error, with `prefix` put before the field path.
    #[must_use]
    pub fn within(mut self, prefix: &str) -> Self {
        self.field = if self.field.is_empty() { prefix.to_owned() } else { format!("{prefix}.{}", self.field) };
        self
    }
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() { f.write_str(&self.message) } else { write!(f, "{}: {}", self.field, self.message) }
    }
}

impl std::error::Error for PolicyError {}

/// Why a policy file could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    /// The file could not be read.
    Io(std::path::PathBuf, std::io::Error),
    /// The text is not valid TOML or JSON for a policy; the message carries the line and
    /// column.
    Parse(String),
    /// The policy parsed but is not valid.
    Invalid(PolicyError),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Io(path, e) => write!(f, "cannot read {}: {e}", path.display()),
            LoadError::Parse(msg) => write!(f, "invalid policy: {msg}"),
            LoadError::Invalid(e) => write!(f, "invalid policy: {e}"),
        }
    }
}

impl std::error::Error for LoadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LoadError::Io(_, e) => Some(e),
            LoadError::Invalid(e) => Some(e),
            LoadError::Parse(_) => None,
        }
    }
}

/// The algorithm of a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlgorithmKind {
    /// [`Gcra`](crate::algorithm::Gcra): `rate` and `burst`.
    Gcra,
    /// [`TokenBucket`](crate::algorithm::TokenBucket): `rate` and `burst`.
    TokenBucket,
    /// [`SlidingWindowLog`](crate::algorithm::SlidingWindowLog): `limit` and `window`.
    SlidingWindowLog,
    /// [`SlidingWindowCounter`](crate::algorithm::SlidingWindowCounter): `limit` and `window`.
    SlidingWindowCounter,
    /// [`FixedWindow`](crate::algorithm::FixedWindow): `limit` and `window`.
    FixedWindow,
    /// [`Semaphore`](crate::algorithm::Semaphore): `capacity`.
    Semaphore,
}

impl AlgorithmKind {
    /// The name used in policy files.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            AlgorithmKind::Gcra => "gcra",
            AlgorithmKind::TokenBucket => "token_bucket",
            AlgorithmKind::SlidingWindowLog => "sliding_window_log",
            AlgorithmKind::SlidingWindowCounter => "sliding_window_counter",
            AlgorithmKind::FixedWindow => "fixed_window",
            AlgorithmKind::Semaphore => "semaphore",
        }
    }
}

/// Whose capacity a limit counts: everyone's, or each key's at one tier.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum Scope {
    /// One state shared by every request.
    #[default]
    Global,
    /// One state per key at the named tier (and the tiers above it).
    Tier(String),
}

impl Serialize for Scope {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Scope::Global => s.serialize_str("global"),
            Scope::Tier(t) => s.serialize_str(t),
        }
    }
}

impl<'de> Deserialize<'de> for Scope {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(if s == "global" { Scope::Global } else { Scope::Tier(s) })
    }
}

/// What one request costs against a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Counts {
    /// One per request, whatever the request's cost: requests per minute, concurrent
    /// requests.
    #[default]
    Requests,
    /// The request's cost (for example its estimated tokens), settled to the real usage
    /// afterwards: tokens per minute.
    Cost,
}

/// One limit of a set.
///
/// The fields a limit needs depend on its algorithm: `rate` and `burst` for `gcra` and
/// `token_bucket`, `limit` and `window` for the windows, `capacity` for `semaphore`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitPolicy {
    /// The name, unique in the set; it names the limit in errors and headers, and keeps
    /// its state when a policy is replaced.
    pub name: String,
    /// The algorithm.
    pub algorithm: AlgorithmKind,
    /// Global (the default), or the tier it is keyed by.
    #[serde(default)]
    pub scope: Scope,
    /// What a request costs against it: one (the default) or the request's cost.
    #[serde(default)]
    pub counts: Counts,
    /// For `gcra` and `token_bucket`: the sustained rate, as `"600/1m"` or `"10/s"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    /// For `gcra` and `token_bucket`: the most that can be granted at once. Defaults to
    /// the rate's amount (a full period's worth).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    /// For the windows: the most per window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// For the windows: the window's length, as `"1m"` or `"500ms"`.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "opt_duration")]
    pub window: Option<Duration>,
    /// For `semaphore`: how many permits can be held at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
}

impl LimitPolicy {
    fn bare(name: impl Into<String>, algorithm: AlgorithmKind) -> Self {
        LimitPolicy {
            name: name.into(),
            algorithm,
            scope: Scope::Global,
            counts: Counts::Requests,
            rate: None,
            burst: None,
            limit: None,
            window: None,
            capacity: None,
        }
    }

    /// A GCRA limit.
    #[must_use]
    pub fn gcra(name: impl Into<String>, rate: Rate, burst: u64) -> Self {
        LimitPolicy { rate: Some(rate), burst: Some(burst), ..Self::bare(name, AlgorithmKind::Gcra) }
    }

    /// A token bucket.
    #[must_use]
    pub fn token_bucket(name: impl Into<String>, rate: Rate, burst: u64) -> Self {
        LimitPolicy { rate: Some(rate), burst: Some(burst), ..Self::bare(name, AlgorithmKind::TokenBucket) }
    }

    /// An exact sliding-window log.
    #[must_use]
    pub fn sliding_window_log(name: impl Into<String>, limit: u64, window: Duration) -> Self {
        LimitPolicy { limit: Some(limit), window: Some(window), ..Self::bare(name, AlgorithmKind::SlidingWindowLog) }
    }

    /// An approximate sliding-window counter.
    #[must_use]
    pub fn sliding_window_counter(name: impl Into<String>, limit: u64, window: Duration) -> Self {
        LimitPolicy {
            limit: Some(limit),
            window: Some(window),
            ..Self::bare(name, AlgorithmKind::SlidingWindowCounter)
        }
    }

    /// A fixed window.
    #[must_use]
    pub fn fixed_window(name: impl Into<String>, limit: u64, window: Duration) -> Self {
        LimitPolicy { limit: Some(limit), window: Some(window), ..Self::bare(name, AlgorithmKind::FixedWindow) }
    }

    /// A semaphore: concurrency.
    #[must_use]
    pub fn semaphore(name: impl Into<String>, capacity: u64) -> Self {
        LimitPolicy { capacity: Some(capacity), ..Self::bare(name, AlgorithmKind::Semaphore) }
    }

    /// Keyed by `tier` instead of global.
    #[must_use]
    pub fn per(mut self, tier: impl Into<String>) -> Self {
        self.scope = Scope::Tier(tier.into());
        self
    }

    /// Counting each request's cost instead of one per request.
    #[must_use]
    pub fn counting_cost(mut self) -> Self {
        self.counts = Counts::Cost;
        self
    }
}

/// The most limits one set can hold.
pub const MAX_LIMITS: usize = 16;

/// The default bound on tracked keys of a set.
pub const DEFAULT_MAX_KEYS: usize = 100_000;

/// A set of limits acquired together, all or nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSetPolicy {
    /// The tiers of tenant keys, broadest first (`["org", "team", "user", "agent"]`).
    #[serde(default)]
    pub tiers: Vec<String>,
    /// The most (limit, key) states tracked at once in memory; idle ones are evicted to
    /// make room. Defaults to 100,000.
    #[serde(default = "default_max_keys")]
    pub max_keys: usize,
    /// The limits. In TOML, each is a `[[limit]]` table.
    #[serde(default, rename = "limit", alias = "limits")]
    pub limits: Vec<LimitPolicy>,
}

fn default_max_keys() -> usize {
    DEFAULT_MAX_KEYS
}

impl Default for LimitSetPolicy {
    fn default() -> Self {
        LimitSetPolicy { tiers: Vec::new(), max_keys: DEFAULT_MAX_KEYS, limits: Vec::new() }
    }
}

impl LimitSetPolicy {
    /// An empty policy with no tiers.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// With these tiers, broadest first.
    #[must_use]
    pub fn tiers<I: IntoIterator<Item = S>, S: Into<String>>(mut self, tiers: I) -> Self {
        self.tiers = tiers.into_iter().map(Into::into).collect();
        self
    }

    /// With one more limit.
    #[must_use]
    pub fn limit(mut self, limit: LimitPolicy) -> Self {
        self.limits.push(limit);
        self
    }

    /// With a bound on tracked keys.
    #[must_use]
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// Parses a TOML policy and validates it.
    ///
    /// # Errors
    /// [`LoadError::Parse`] with the line, or [`LoadError::Invalid`] with the field.
    pub fn from_toml(text: &str) -> Result<Self, LoadError> {
        let policy: Self = toml::from_str(text).map_err(|e| LoadError::Parse(e.to_string()))?;
        policy.validate().map_err(LoadError::Invalid)?;
        Ok(policy)
    }

    /// Parses a JSON policy and validates it.
    ///
    /// # Errors
    /// [`LoadError::Parse`] with the line, or [`LoadError::Invalid`] with the field.
    pub fn from_json(text: &str) -> Result<Self, LoadError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let policy: Self = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            LoadError::Parse(if path == "." {
                e.into_inner().to_string()
            } else {
                format!("{path}: {}", e.into_inner())
            })
        })?;
        policy.validate().map_err(LoadError::Invalid)?;
        Ok(policy)
    }

    /// Reads a `.toml` or `.json` file (by its extension; TOML otherwise) and validates it.
    ///
    /// # Errors
    /// [`LoadError`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| LoadError::Io(path.to_owned(), e))?;
        let result =
            if path.extension().is_some_and(|e| e == "json") { Self::from_json(&text) } else { Self::from_toml(&text) };
        result.map_err(|e| match e {
            LoadError::Parse(msg) => LoadError::Parse(format!("{}: {msg}", path.display())),
            other => other,
        })
    }

    /// Checks the policy without building anything.
    ///
    /// # Errors
    /// The first problem found, naming its field.
    pub fn validate(&self) -> Result<(), PolicyError> {
        crate::limit::Config::build(self).map(|_| ())
    }
}

/// Formats a duration in the largest unit that divides it (`90s` as `90s`, `2m` as `2m`).
#[must_use]
pub fn format_duration(d: Duration) -> String {
    let n = d.as_nanos();
    const UNITS: [(u128, &str); 7] = [
        (86_400_000_000_000, "d"),
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
        (1, "ns"),
    ];
    if n == 0 {
        return "0s".to_owned();
    }
    for (size, unit) in UNITS {
        if n % size == 0 {
            return format!("{}{unit}", n / size);
        }
    }
    unreachable!("every duration is a whole number of nanoseconds")
}

/// Parses a duration such as `1m`, `500ms`, `1h30m` or `2d`.
///
/// # Errors
/// A message saying what was expected.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("expected a duration such as \"1m\" or \"500ms\", got an empty string".into());
    }
    let mut total: u128 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!("expected a number in duration {text:?}"));
        }
        let value: u128 = rest[..digits].parse().map_err(|_| format!("number too large in duration {text:?}"))?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let nanos: u128 = match rest[..unit_len].trim() {
            "ns" => 1,
            "us" | "µs" => 1_000,
            "ms" => 1_000_000,
            "s" | "sec" => 1_000_000_000,
            "m" | "min" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "d" => 86_400_000_000_000,
            "" => return Err(format!("missing unit in duration {text:?} (use ns, us, ms, s, m, h or d)")),
            other => return Err(format!("unknown unit {other:?} in duration {text:?} (use ns, us, ms, s, m, h or d)")),
        };
        rest = &rest[unit_len..];
        total = value
            .checked_mul(nanos)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(|| format!("duration {text:?} is too long"))?;
    }
    u64::try_from(total).map(Duration::from_nanos).map_err(|_| format!("duration {text:?} is too long"))
}

/// Parses a rate such as `600/1m`, `10/s` or `1000000/minute`.
///
/// # Errors
/// A message saying what was expected.
pub fn parse_rate(text: &str) -> Result<Rate, String> {
    let (amount, period) =
        text.split_once('/').ok_or_else(|| format!("expected a rate such as \"600/1m\" or \"10/s\", got {text:?}"))?;
    let amount: u64 = amount
        .trim()
        .replace('_', "")
        .parse()
        .map_err(|_| format!("expected a whole number before '/' in rate {text:?}"))?;
    let period = match period.trim() {
        "s" | "sec" | "second" => Duration::from_secs(1),
        "m" | "min" | "minute" => Duration::from_secs(60),
        "h" | "hour" => Duration::from_secs(3600),
        "d" | "day" => Duration::from_secs(86_400),
        other => parse_duration(other)?,
    };
    Ok(Rate::new(amount, period))
}

/// The textual form of [`Rate`] in policy files.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
#[doc(hidden)]
pub struct RateRepr(String);

impl TryFrom<RateRepr> for Rate {
    type Error = String;
    fn try_from(r: RateRepr) -> Result<Rate, String> {
        parse_rate(&r.0)
    }
}

impl From<Rate> for RateRepr {
    fn from(r: Rate) -> RateRepr {
        RateRepr(r.to_string())
    }
}

mod opt_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&super::format_duration(*d)),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text = String::deserialize(d)?;
        super::parse_duration(&text).map(Some).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_trip() {
        for text in ["1m", "500ms", "2d", "90s", "7ns", "3h"] {
            assert_eq!(format_duration(parse_duration(text).unwrap()), text);
        }
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert!(parse_duration("10").unwrap_err().contains("missing unit"));
        assert!(parse_duration("10 parsecs").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn rates_parse() {
        assert_eq!(parse_rate("600/1m").unwrap(), Rate::per_minute(600));
        assert_eq!(parse_rate("10/s").unwrap(), Rate::per_second(10));
        assert_eq!(parse_rate("1_000_000/minute").unwrap(), Rate::per_minute(1_000_000));
        assert!(parse_rate("ten/s").is_err());
        assert!(parse_rate("10").is_err());
    }

    #[test]
    fn json_and_toml_agree() {
        let policy = LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("rpm", Rate::per_minute(60), 10).per("user"))
            .limit(LimitPolicy::semaphore("concurrent", 4).per("org"))
            .limit(LimitPolicy::sliding_window_log("daily", 1000, Duration::from_secs(86_400)).counting_cost());
        let json = serde_json::to_string(&policy).unwrap();
        assert_eq!(LimitSetPolicy::from_json(&json).unwrap(), policy);
        let toml = toml::to_string(&policy).unwrap();
        assert_eq!(LimitSetPolicy::from_toml(&toml).unwrap(), policy);
    }

    #[test]
    fn parse_errors_carry_the_line() {
        let err =
            LimitSetPolicy::from_toml("[[limit]]\nname = \"x\"\nalgorithm = \"gcra\"\nrate = \"fast\"\n").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("line 4"), "{text}");
        assert!(text.contains("expected a rate"), "{text}");
        let err =
            LimitSetPolicy::from_toml("[[limit]]\nname = \"x\"\nalgorithm = \"gcra\"\nrat = \"1/s\"\n").unwrap_err();
        assert!(err.to_string().contains("unknown field `rat`"), "{err}");
    }
}
