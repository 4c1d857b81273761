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
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::algorithm::{
    CalendarPeriod, CalendarWindow, FixedWindow, Gcra, Semaphore, SlidingWindowCounter, SlidingWindowLog, TokenBucket,
};
use crate::key::MAX_TIERS;
use crate::limit::{Config, LimitDef, Shape, VERSIONS, intern};
use crate::rate::{Quota, Rate};

pub use crate::limit::{AlgorithmKind, Counts, Limit, MAX_LIMITS, Scope};
pub use crate::policy_error::PolicyError;
#[doc(hidden)]
pub use crate::rate::RateRepr;
pub use crate::rate::parse_rate;
pub use crate::time::{format_duration, parse_duration};

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

/// One limit of a set.
///
/// The fields a limit needs depend on its algorithm: `rate` and `burst` for `gcra` and
/// `token_bucket`, `limit` and `window` for the windows, `limit`, `period` and `timezone`
/// for `calendar_window`, `capacity` for `semaphore`. The
/// fields are data, as a policy file gives them, and are checked when the policy is
/// validated; in code, the constructors take what they need ready-made:
/// [`LimitPolicy::gcra`] and [`LimitPolicy::token_bucket`] fill `rate` and `burst` from a
/// [`Quota`], valid by construction.
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
    /// For `gcra` and `token_bucket`: the sustained rate, as `"600/1m"` or `"10/s"` (a
    /// [`Quota`]'s [`rate`](Quota::rate)).
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
    /// For `calendar_window`: the calendar period the `limit` is counted over (`"day"`,
    /// `"week"`, `"month"` or `"year"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<CalendarPeriod>,
    /// For `calendar_window`: the time zone whose midnights start the periods, a name of
    /// the IANA database (`"Europe/Berlin"`, `"UTC"`). Required: a budget's reset is a
    /// promise to people, who live in a time zone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    /// For `calendar_window`: the wall-clock time at which the clock driving the set
    /// reads [`Instant::ZERO`](crate::Instant::ZERO). Unset, it is
    /// [`unix_origin`](crate::time::unix_origin), right for every clock this library makes;
    /// set it when a [`ManualClock`](crate::ManualClock) drives the set. Not read from
    /// policy files.
    #[serde(skip)]
    pub clock_origin: Option<SystemTime>,
    /// Shadow mode: the limit decides and counts, but never refuses. A request it would
    /// have refused is admitted without charging it (so its state stays what it would be
    /// if it enforced), and counted in [`LimitStats::shadow_refused`](crate::LimitStats::shadow_refused).
    /// For trying a new limit on live traffic before enforcing it. In memory only: the
    /// Redis backend refuses a policy with a shadow limit.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shadow: bool,
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
            period: None,
            timezone: None,
            clock_origin: None,
            shadow: false,
        }
    }

    /// A GCRA limit of `quota`: its `rate` and `burst` fields are the quota's.
    ///
    /// ```
    /// use tower_limits_core::{LimitPolicy, Quota, nz};
    ///
    /// let limit = LimitPolicy::gcra("rpm", Quota::per_minute(nz!(600)).burst(nz!(20)));
    /// assert_eq!(limit.rate.map(|r| r.to_string()).as_deref(), Some("600/1m"));
    /// assert_eq!(limit.burst, Some(20));
    /// ```
    #[must_use]
    pub fn gcra(name: impl Into<String>, quota: Quota) -> Self {
        Self::rate_limit(name, AlgorithmKind::Gcra, quota)
    }

    /// A token bucket of `quota`: the bucket holds its burst and refills at its rate.
    #[must_use]
    pub fn token_bucket(name: impl Into<String>, quota: Quota) -> Self {
        Self::rate_limit(name, AlgorithmKind::TokenBucket, quota)
    }

    fn rate_limit(name: impl Into<String>, algorithm: AlgorithmKind, quota: Quota) -> Self {
        LimitPolicy { rate: Some(quota.rate()), burst: Some(quota.max_burst()), ..Self::bare(name, algorithm) }
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

    /// A calendar window: at most `limit` per `period`, the periods starting at midnight
    /// in `timezone` (see [`CalendarWindow`]). A budget counts cost: add
    /// [`counting_cost`](LimitPolicy::counting_cost).
    ///
    /// ```
    /// use tower_limits_core::{LimitPolicy, LimitSetPolicy};
    /// use tower_limits_core::algorithm::CalendarPeriod;
    ///
    /// // 100 USD a month per team, in micro-dollars.
    /// let budget = LimitPolicy::calendar_window("usd-per-month", 100_000_000, CalendarPeriod::Month, "Europe/Berlin")
    ///     .per("team")
    ///     .counting_cost();
    /// LimitSetPolicy::new().tiers(["org", "team"]).limit(budget).validate()?;
    /// # Ok::<(), tower_limits_core::PolicyError>(())
    /// ```
    #[must_use]
    pub fn calendar_window(
        name: impl Into<String>,
        limit: u64,
        period: CalendarPeriod,
        timezone: impl Into<String>,
    ) -> Self {
        LimitPolicy {
            limit: Some(limit),
            period: Some(period),
            timezone: Some(timezone.into()),
            ..Self::bare(name, AlgorithmKind::CalendarWindow)
        }
    }

    /// For a calendar window driven by a clock that reads [`Instant::ZERO`](crate::Instant::ZERO)
    /// at `origin` (see [`LimitPolicy::clock_origin`](LimitPolicy#structfield.clock_origin)).
    #[must_use]
    pub fn with_clock_origin(mut self, origin: SystemTime) -> Self {
        self.clock_origin = Some(origin);
        self
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

    /// In shadow mode: it decides and counts what it would refuse, but never refuses (see
    /// [`LimitPolicy::shadow`](LimitPolicy#structfield.shadow)).
    ///
    /// ```
    /// use tower_limits_core::{Instant, LimitPolicy, LimitSet, LimitSetPolicy, Quota, TenantKey, nz};
    ///
    /// let set = LimitSet::new(
    ///     LimitSetPolicy::new().limit(LimitPolicy::gcra("trial", Quota::per_second(nz!(1))).shadow()),
    /// )?;
    /// let now = Instant::ZERO;
    /// let global = TenantKey::global();
    /// assert!(set.acquire(&global, 1, now).is_ok());
    /// assert!(set.acquire(&global, 1, now).is_ok()); // would have been refused
    /// assert_eq!(set.stats().limits[0].shadow_refused, 1);
    /// # Ok::<(), tower_limits_core::PolicyError>(())
    /// ```
    #[must_use]
    pub fn shadow(mut self) -> Self {
        self.shadow = true;
        self
    }
}

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
        Config::build(self).map(|_| ())
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

impl Limit {
    /// Builds the limit a policy describes.
    ///
    /// # Errors
    /// A missing, unused or invalid parameter, naming the field.
    pub fn from_policy(p: &LimitPolicy) -> Result<Limit, PolicyError> {
        let kind = p.algorithm;
        let unused = |field: &str, present: bool| {
            if present { Err(PolicyError::new(field, format!("is not used by {}", kind.as_str()))) } else { Ok(()) }
        };
        let required = |field: &str| PolicyError::new(field, format!("is required by {}", kind.as_str()));
        if kind != AlgorithmKind::CalendarWindow {
            unused("period", p.period.is_some())?;
            unused("timezone", p.timezone.is_some())?;
        }
        match kind {
            AlgorithmKind::Gcra | AlgorithmKind::TokenBucket => {
                unused("limit", p.limit.is_some())?;
                unused("window", p.window.is_some())?;
                unused("capacity", p.capacity.is_some())?;
                let rate = p.rate.ok_or_else(|| required("rate"))?;
                let quota = Quota::of_policy(rate, p.burst.unwrap_or(rate.amount()))?;
                Ok(if kind == AlgorithmKind::Gcra {
                    Limit::Gcra(Gcra::new(quota))
                } else {
                    Limit::TokenBucket(TokenBucket::new(quota))
                })
            }
            AlgorithmKind::SlidingWindowLog | AlgorithmKind::SlidingWindowCounter | AlgorithmKind::FixedWindow => {
                unused("rate", p.rate.is_some())?;
                unused("burst", p.burst.is_some())?;
                unused("capacity", p.capacity.is_some())?;
                let limit = p.limit.ok_or_else(|| required("limit"))?;
                let window = p.window.ok_or_else(|| required("window"))?;
                Ok(match kind {
                    AlgorithmKind::SlidingWindowLog => Limit::SlidingWindowLog(SlidingWindowLog::new(limit, window)?),
                    AlgorithmKind::SlidingWindowCounter => {
                        Limit::SlidingWindowCounter(SlidingWindowCounter::new(limit, window)?)
                    }
                    _ => Limit::FixedWindow(FixedWindow::new(limit, window)?),
                })
            }
            AlgorithmKind::CalendarWindow => {
                unused("rate", p.rate.is_some())?;
                unused("burst", p.burst.is_some())?;
                unused("window", p.window.is_some())?;
                unused("capacity", p.capacity.is_some())?;
                let limit = p.limit.ok_or_else(|| required("limit"))?;
                let period = p.period.ok_or_else(|| required("period"))?;
                let zone = p.timezone.as_deref().ok_or_else(|| required("timezone"))?;
                let window = CalendarWindow::new(limit, period, zone)?;
                Ok(Limit::CalendarWindow(match p.clock_origin {
                    Some(origin) => window.with_origin(origin),
                    None => window,
                }))
            }
            AlgorithmKind::Semaphore => {
                unused("rate", p.rate.is_some())?;
                unused("burst", p.burst.is_some())?;
                unused("limit", p.limit.is_some())?;
                unused("window", p.window.is_some())?;
                Ok(Limit::Semaphore(Semaphore::new(p.capacity.ok_or_else(|| required("capacity"))?)?))
            }
        }
    }
}

impl Config {
    pub(crate) fn build(policy: &LimitSetPolicy) -> Result<Config, PolicyError> {
        if policy.tiers.len() > MAX_TIERS {
            return Err(PolicyError::new("tiers", format!("at most {MAX_TIERS} tiers, got {}", policy.tiers.len())));
        }
        for (i, tier) in policy.tiers.iter().enumerate() {
            let field = format!("tiers[{i}]");
            if tier.is_empty() {
                return Err(PolicyError::new(field, "a tier needs a name"));
            }
            if tier == "global" {
                return Err(PolicyError::new(field, "\"global\" is reserved for limits shared by every key"));
            }
            if policy.tiers[..i].contains(tier) {
                return Err(PolicyError::new(field, format!("tier {tier:?} is listed twice")));
            }
        }
        if policy.limits.is_empty() {
            return Err(PolicyError::new("limit", "a limit set needs at least one limit"));
        }
        if policy.limits.len() > MAX_LIMITS {
            return Err(PolicyError::new(
                "limit",
                format!("a limit set holds at most {MAX_LIMITS} limits, got {}", policy.limits.len()),
            ));
        }
        if policy.max_keys == 0 {
            return Err(PolicyError::new("max_keys", "must be at least 1"));
        }
        let keyed = policy.limits.iter().filter(|l| l.scope != Scope::Global).count();
        if policy.max_keys < keyed {
            return Err(PolicyError::new(
                "max_keys",
                format!("must be at least {keyed}, the number of keyed limits: one key needs a state in each"),
            ));
        }
        let mut limits = Vec::with_capacity(policy.limits.len());
        for (i, p) in policy.limits.iter().enumerate() {
            let at = if p.name.is_empty() { format!("limits[{i}]") } else { format!("limits[{i}] ({})", p.name) };
            if p.name.is_empty() {
                return Err(PolicyError::new("name", "a limit needs a name").within(&at));
            }
            if let Some(j) = policy.limits[..i].iter().position(|q| q.name == p.name) {
                return Err(
                    PolicyError::new("name", format!("{:?} is already the name of limits[{j}]", p.name)).within(&at)
                );
            }
            let tier = match &p.scope {
                Scope::Global => None,
                Scope::Tier(t) => Some(policy.tiers.iter().position(|x| x == t).ok_or_else(|| {
                    let known = if policy.tiers.is_empty() {
                        "the set declares no tiers".to_owned()
                    } else {
                        format!("tiers are {}", policy.tiers.join(", "))
                    };
                    PolicyError::new("scope", format!("unknown tier {t:?} ({known})")).within(&at)
                })?),
            };
            let limit = Limit::from_policy(p).map_err(|e| e.within(&at))?;
            limits.push(LimitDef { name: intern(&p.name), tier, counts: p.counts, limit, shadow: p.shadow });
        }
        let tiers: Vec<&'static str> = policy.tiers.iter().map(|t| intern(t)).collect();
        Ok(Config {
            version: VERSIONS.fetch_add(1, Ordering::Relaxed),
            shape: Shape::interned(&tiers, &limits),
            tiers,
            has_global: limits.iter().any(|l| l.tier.is_none()),
            has_tiered: limits.iter().any(|l| l.tier.is_some()),
            has_semaphore: limits.iter().any(|l| l.limit.is_semaphore()),
            // A key too short for a shadow limit is not refused: that limit would have.
            depth_needed: limits.iter().filter(|l| !l.shadow).filter_map(|l| l.tier).map(|t| t + 1).max().unwrap_or(0),
            max_keys: policy.max_keys,
            fresh: limits.iter().map(|l| l.limit.fresh()).collect(),
            keyed_limits: limits.iter().filter(|l| l.tier.is_some()).count(),
            one_keyed: match limits.as_slice() {
                [one] if !one.shadow => one.tier,
                _ => None,
            },
            tiers_used: (0..policy.tiers.len()).filter(|&t| limits.iter().any(|l| l.tier == Some(t))).collect(),
            keyed_semaphores: limits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.limit.is_semaphore())
                .filter_map(|(i, l)| l.tier.map(|t| (i, t)))
                .collect(),
            global_semaphore: limits.iter().any(|l| l.limit.is_semaphore() && l.tier.is_none()),
            limits,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nz;

    /// Grants refer to their policy's shape without a reference count: it is stored once
    /// per distinct shape, however often a set is built or replaced with it.
    #[test]
    fn a_shape_is_stored_once() {
        let policy = |per_second: u64| {
            let quota = Quota::try_new(per_second, Duration::from_secs(1)).unwrap().burst(nz!(2));
            LimitSetPolicy::new()
                .tiers(["org", "user"])
                .limit(LimitPolicy::gcra("requests", quota).per("user"))
                .limit(LimitPolicy::semaphore("concurrent", 4).per("org"))
        };
        let (a, b) = (Config::build(&policy(10)).unwrap(), Config::build(&policy(20)).unwrap());
        assert!(std::ptr::eq(a.shape, b.shape), "quotas are not part of the shape");
        assert_ne!(a.version, b.version);
        let other = Config::build(&policy(10).limit(LimitPolicy::semaphore("more", 4).per("user"))).unwrap();
        assert!(!std::ptr::eq(a.shape, other.shape));
        assert_eq!(other.shape.limits.len(), 3);
        assert!(other.shape.has_semaphore);
        assert_eq!((other.shape.limits[2].name, other.shape.limits[2].tier), ("more", Some(1)));
    }

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
        let minute = Duration::from_secs(60);
        assert_eq!(parse_rate("600/1m").unwrap(), Rate::new(600, minute));
        assert_eq!(parse_rate("10/s").unwrap(), Rate::new(10, Duration::from_secs(1)));
        assert_eq!(parse_rate("1_000_000/minute").unwrap(), Rate::new(1_000_000, minute));
        assert!(parse_rate("ten/s").is_err());
        assert!(parse_rate("10").is_err());
    }

    #[test]
    fn json_and_toml_agree() {
        let policy = LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("rpm", Quota::per_minute(nz!(60)).burst(nz!(10))).per("user"))
            .limit(LimitPolicy::semaphore("concurrent", 4).per("org"))
            .limit(LimitPolicy::sliding_window_log("daily", 1000, Duration::from_secs(86_400)).counting_cost());
        let json = serde_json::to_string(&policy).unwrap();
        assert_eq!(LimitSetPolicy::from_json(&json).unwrap(), policy);
        let toml = toml::to_string(&policy).unwrap();
        assert_eq!(LimitSetPolicy::from_toml(&toml).unwrap(), policy);
    }

    #[test]
    fn calendar_budgets_load_from_toml_and_name_their_fields() {
        let text = |extra: &str| {
            format!(
                "tiers = [\"team\"]\n[[limit]]\nname = \"usd-month\"\nscope = \"team\"\ncounts = \"cost\"\n\
                 algorithm = \"calendar_window\"\nlimit = 100000000\n{extra}"
            )
        };
        let policy = LimitSetPolicy::from_toml(&text("period = \"month\"\ntimezone = \"Europe/Berlin\"\n")).unwrap();
        let expected = LimitPolicy::calendar_window("usd-month", 100_000_000, CalendarPeriod::Month, "Europe/Berlin")
            .per("team")
            .counting_cost();
        assert_eq!(policy.limits, [expected]);
        assert_eq!(LimitSetPolicy::from_toml(&toml::to_string(&policy).unwrap()).unwrap(), policy);
        let invalid = |extra: &str| LimitSetPolicy::from_toml(&text(extra)).unwrap_err().to_string();
        assert!(invalid("period = \"month\"\n").contains("limits[0] (usd-month).timezone: is required"));
        assert!(invalid("timezone = \"UTC\"\n").contains("limits[0] (usd-month).period: is required"));
        let zone = invalid("period = \"month\"\ntimezone = \"Europe/Atlantis\"\n");
        assert!(zone.contains("limits[0] (usd-month).timezone: \"Europe/Atlantis\" is not a time zone"), "{zone}");
        let period = invalid("period = \"fortnight\"\ntimezone = \"UTC\"\n");
        assert!(period.contains("line 8") && period.contains("fortnight"), "{period}");
        let misplaced = LimitSetPolicy::new().limit(LimitPolicy {
            timezone: Some("UTC".into()),
            ..LimitPolicy::fixed_window("w", 1, Duration::from_secs(1))
        });
        assert_eq!(
            misplaced.validate().unwrap_err().to_string(),
            "limits[0] (w).timezone: is not used by fixed_window"
        );
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

#[cfg(test)]
mod validation_tests {
    use std::time::Duration;

    use super::*;
    use crate::nz;

    fn err(policy: &LimitSetPolicy) -> String {
        Config::build(policy).unwrap_err().to_string()
    }

    #[test]
    fn validation_names_the_field() {
        let base = || LimitSetPolicy::new().tiers(["org", "user"]);
        // A policy's fields are data, and may be invalid: a quota cannot be.
        let mut p = LimitPolicy::gcra("rpm", Quota::per_minute(nz!(10)).burst(nz!(1)));
        p.rate = Some(Rate::new(0, Duration::from_secs(60)));
        assert_eq!(err(&base().limit(p)), "limits[0] (rpm).rate: the amount must be at least 1");
        let mut p = LimitPolicy::gcra("rpm", Quota::per_minute(nz!(10)));
        p.burst = Some(0);
        assert_eq!(err(&base().limit(p)), "limits[0] (rpm).burst: must be at least 1");
        assert_eq!(
            err(&base().limit(LimitPolicy::semaphore("c", 1)).limit(LimitPolicy::semaphore("c", 2))),
            "limits[1] (c).name: \"c\" is already the name of limits[0]"
        );
        assert_eq!(
            err(&base().limit(LimitPolicy::semaphore("c", 1).per("usr"))),
            "limits[0] (c).scope: unknown tier \"usr\" (tiers are org, user)"
        );
        assert_eq!(err(&base()), "limit: a limit set needs at least one limit");
        let mut p = LimitPolicy::semaphore("c", 1);
        p.rate = Some(Rate::new(1, Duration::from_secs(1)));
        assert_eq!(err(&base().limit(p)), "limits[0] (c).rate: is not used by semaphore");
        let mut p = LimitPolicy::fixed_window("w", 1, Duration::from_secs(1));
        p.window = None;
        assert_eq!(err(&base().limit(p)), "limits[0] (w).window: is required by fixed_window");
        assert_eq!(
            err(&LimitSetPolicy::new().tiers(["org", "org"]).limit(LimitPolicy::semaphore("c", 1))),
            "tiers[1]: tier \"org\" is listed twice"
        );
    }

    #[test]
    fn burst_defaults_to_the_rate_amount() {
        let mut p = LimitPolicy::gcra("rpm", Quota::per_minute(nz!(600)).burst(nz!(1)));
        p.burst = None;
        match Limit::from_policy(&p).unwrap() {
            Limit::Gcra(g) => assert_eq!(g.quota(), Quota::per_minute(nz!(600))),
            other => panic!("{other:?}"),
        }
    }
}
