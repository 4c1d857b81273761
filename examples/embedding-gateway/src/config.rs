//! The gateway's configuration: one TOML file with the tiers, the plans (limits per
//! tier), the tenants and their API keys, the upstream accounts, and the demo's clients.
//!
//! Every error, whether TOML syntax, a wrong type or a value that does not make sense,
//! names the field and the line it is on:
//!
//! ```text
//! gateway.toml, line 41, column 10: tenant[1].weight: must be at least 1
//! ```
//!
//! Leaves are read as [`toml::Spanned`] values, so validation after parsing still knows
//! where each value was written. See `gateway.toml` next to this crate for a commented
//! example (the one the demo runs).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;
use tower_limits::core::policy::parse_duration;
use tower_limits::{LimitPolicy, LimitSetPolicy, Rate, Selection, TenantKey};

/// A configuration problem: the field, where it was written, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file, when the text came from one.
    pub file: Option<String>,
    /// The line (1-based), when known.
    pub line: Option<usize>,
    /// The column (1-based, in characters), when known.
    pub column: Option<usize>,
    /// The field, as a path (`tenant[1].weight`).
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let file = self.file.as_deref().unwrap_or("config");
        match (self.line, self.column) {
            (Some(line), Some(column)) => write!(f, "{file}, line {line}, column {column}: ")?,
            (Some(line), None) => write!(f, "{file}, line {line}: ")?,
            _ => write!(f, "{file}: ")?,
        }
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Tiers of every tenant key, broadest first (`org`, `team`, `user`, `agent`).
    pub tiers: Vec<String>,
    /// How the gateway serves.
    pub gateway: GatewaySettings,
    /// How the local mirror of each upstream account is sized.
    pub mirror: MirrorSettings,
    /// How the mock upstream answers.
    pub upstream: UpstreamSettings,
    /// The plans: each is the limit set of the tenants on it.
    pub plans: Vec<Plan>,
    /// The tenants, each one of the fair queue's flows.
    pub tenants: Vec<Tenant>,
    /// The upstream provider's accounts the gateway spreads requests over.
    pub accounts: Vec<Account>,
    /// The demo's clients.
    pub demo: DemoSettings,
}

/// How the gateway serves.
#[derive(Debug, Clone)]
pub struct GatewaySettings {
    /// Where `serve` listens.
    pub listen: SocketAddr,
    /// The longest a request waits in the fair queue for upstream capacity before a 503.
    pub max_wait: Duration,
    /// The most tokens one request may carry (above it: 413 at once).
    pub max_request_tokens: u64,
    /// The largest request body read, in bytes.
    pub max_body_bytes: usize,
    /// The tier whose members share the upstream capacity by weight (the tenant).
    pub fair_tier: String,
    /// The most requests one tenant may have queued.
    pub tenant_queue: usize,
    /// The most requests queued in all.
    pub queue: usize,
    /// How an upstream account is chosen for each request.
    pub selection: Selection,
    /// The models `GET /v1/models` lists and requests may name (others: `404`).
    pub models: Vec<String>,
    /// How long a client has to send a request's headers once its connection is open, or
    /// once it sent the first byte of the next request.
    pub header_timeout: Duration,
    /// How long a keep-alive connection may sit idle between requests.
    pub idle_timeout: Duration,
    /// How long a client has to send a request's body once its headers arrived (`408`).
    pub body_timeout: Duration,
    /// The most client connections open at once; beyond it new connections wait in the
    /// listen backlog until one closes.
    pub max_connections: usize,
    /// On SIGTERM or SIGINT: how long requests in flight get to finish before the process
    /// exits anyway.
    pub shutdown_grace: Duration,
    /// The longest an upstream call may take, answer included (`504` after it).
    pub upstream_timeout: Duration,
    /// Whether a request whose upstream call timed out keeps its token charge (the
    /// upstream may have counted it) or gets it back.
    pub on_upstream_timeout: TimeoutCharge,
    /// What the tenants' limits do while their shared backend (Redis) cannot answer.
    pub backend_failure: BackendFailure,
}

/// What a request whose upstream call timed out is charged (`gateway.on_upstream_timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutCharge {
    /// Keep the estimate: the upstream may have counted the request (`"keep"`, the default).
    Keep,
    /// Give the tokens back to the tenant's plan and to the account's mirror (`"refund"`).
    Refund,
}

/// What the tenants' limits do while Redis cannot answer (`gateway.backend_failure`;
/// only with `--redis`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendFailure {
    /// Refuse with `503` (`"fail_closed"`).
    FailClosed,
    /// Admit without the tenants' limits (`"fail_open"`); the upstream mirrors still hold.
    FailOpen,
    /// Decide in this replica with `1 / replicas` of every limit (`"fallback"`, the
    /// default).
    Fallback,
}

/// How each upstream account's local mirror is sized (see the crate docs for why).
#[derive(Debug, Clone, Copy)]
pub struct MirrorSettings {
    /// The most by which the delay from admission (in the gateway) to arrival (at the
    /// upstream) may vary between two requests.
    pub jitter: Duration,
    /// The mirror's burst, as a percentage of the upstream's quota per window.
    pub burst_percent: u64,
}

/// How the mock upstream answers.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamSettings {
    /// Where `upstream` listens.
    pub listen: SocketAddr,
    /// Length of each embedding vector.
    pub dimensions: usize,
    /// How long each answer takes.
    pub latency: Duration,
}

/// A plan: limits per tier, shared by every tenant on the plan.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The plan's name.
    pub name: String,
    /// Its limit set.
    pub policy: LimitSetPolicy,
}

/// A tenant: one member of the tier the fair queue shares by (an org by default).
#[derive(Debug, Clone)]
pub struct Tenant {
    /// The tenant's name, its key at the fair tier.
    pub name: String,
    /// Index of its plan in [`Config::plans`].
    pub plan: usize,
    /// Its weight in the fair queue.
    pub weight: u32,
    /// Its API keys.
    pub keys: Vec<ApiKey>,
}

/// One API key and the tenant key it stands for.
#[derive(Debug, Clone)]
pub struct ApiKey {
    /// The bearer token.
    pub secret: String,
    /// The tiers it maps to.
    pub tenant_key: TenantKey,
}

/// One upstream account and the limits its provider enforces on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// The account's name.
    pub name: String,
    /// The provider's base URL (`http://host:port`), without `/v1`.
    pub base_url: String,
    /// The account's API key at the provider.
    pub api_key: String,
    /// Requests per minute.
    pub rpm: u64,
    /// Tokens per minute.
    pub tpm: u64,
    /// The provider enforces `rpm` and `tpm` pro rata over every window this long.
    pub window: Duration,
}

impl Account {
    /// The requests the provider allows in any window of [`Account::window`].
    #[must_use]
    pub fn requests_per_window(&self) -> u64 {
        per_window(self.rpm, self.window)
    }

    /// The tokens the provider allows in any window of [`Account::window`].
    #[must_use]
    pub fn tokens_per_window(&self) -> u64 {
        per_window(self.tpm, self.window)
    }

    /// The local mirror of this account's limits, or of a `1 / replicas` share of them:
    /// a GCRA per quota whose admissions in any span of `window + jitter` stay within
    /// what the provider allows per `window`.
    ///
    /// With quota `L` per window `W`, burst `b` and jitter `J`, the rate is
    /// `(L - b) / (W + J)`: GCRA admits at most `rate * T + b` in any span `T`, so at most
    /// `L` in any `W + J`, and requests admitted that far apart can arrive at most `W`
    /// apart. The burst is `burst_percent` of `L`, at least one request and
    /// `max_request_tokens` tokens.
    ///
    /// # Errors
    /// The quota (or its share) is too small for that burst.
    pub fn mirror_policy(
        &self,
        mirror: &MirrorSettings,
        max_request_tokens: u64,
        replicas: u64,
    ) -> Result<LimitSetPolicy, String> {
        let period = self.window + mirror.jitter;
        let window = tower_limits::core::policy::format_duration(self.window);
        let share = |quota: u64, at_least: u64, what: &str| {
            let l = quota / replicas.max(1);
            let b = mirror_burst(l, mirror, at_least);
            if b >= l {
                let of = if replicas > 1 { format!(" ({replicas} replicas' share)") } else { String::new() };
                return Err(format!(
                    "{l} {what} per {window} window{of} leave no room for a burst of {b} \
                     (mirror.burst_percent, gateway.max_request_tokens): raise it or lengthen `window`"
                ));
            }
            Ok((l, b))
        };
        let (lr, br) = share(self.requests_per_window(), 1, "requests")?;
        let (lt, bt) = share(self.tokens_per_window(), max_request_tokens, "tokens")?;
        Ok(LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("upstream.rpm", Rate::new(lr - br, period), br))
            .limit(LimitPolicy::gcra("upstream.tpm", Rate::new(lt - bt, period), bt).counting_cost()))
    }
}

fn per_window(per_minute: u64, window: Duration) -> u64 {
    (u128::from(per_minute) * window.as_nanos() / 60_000_000_000) as u64
}

fn mirror_burst(quota: u64, mirror: &MirrorSettings, at_least: u64) -> u64 {
    (quota * mirror.burst_percent).div_ceil(100).max(at_least).max(1)
}

/// The demo's clients and pass mark.
#[derive(Debug, Clone)]
pub struct DemoSettings {
    /// How long the demo drives load.
    pub seconds: u64,
    /// How far a tenant's share of the upstream capacity may stray from its weight's
    /// share (absolute, as a fraction of the whole).
    pub tolerance: f64,
    /// The clients.
    pub clients: Vec<DemoClient>,
}

/// One simulated client of the demo.
#[derive(Debug, Clone)]
pub struct DemoClient {
    /// The API key it sends.
    pub key: String,
    /// Inputs per request.
    pub batch: usize,
    /// Words per input.
    pub words: usize,
    /// Requests in flight at once.
    pub concurrency: usize,
}

// ---------------------------------------------------------------------------------------
// The raw form, as written.

type S<T> = Spanned<T>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    tiers: Option<S<Vec<S<String>>>>,
    #[serde(default)]
    gateway: RawGateway,
    #[serde(default)]
    mirror: RawMirror,
    #[serde(default)]
    upstream: RawUpstream,
    #[serde(default)]
    plan: BTreeMap<String, BTreeMap<String, S<RawTierLimits>>>,
    #[serde(default)]
    tenant: Vec<RawTenant>,
    #[serde(default)]
    account: Vec<RawAccount>,
    #[serde(default)]
    demo: RawDemo,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawGateway {
    listen: Option<S<String>>,
    max_wait: Option<S<String>>,
    max_request_tokens: Option<S<u64>>,
    max_body_bytes: Option<S<u64>>,
    fair_tier: Option<S<String>>,
    tenant_queue: Option<S<u64>>,
    queue: Option<S<u64>>,
    selection: Option<S<String>>,
    models: Option<S<Vec<S<String>>>>,
    header_timeout: Option<S<String>>,
    idle_timeout: Option<S<String>>,
    body_timeout: Option<S<String>>,
    max_connections: Option<S<u64>>,
    shutdown_grace: Option<S<String>>,
    upstream_timeout: Option<S<String>>,
    on_upstream_timeout: Option<S<String>>,
    backend_failure: Option<S<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMirror {
    jitter: Option<S<String>>,
    burst_percent: Option<S<u64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    listen: Option<S<String>>,
    dimensions: Option<S<u64>>,
    latency: Option<S<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTierLimits {
    rpm: Option<S<u64>>,
    tpm: Option<S<u64>>,
    concurrency: Option<S<u64>>,
    rpm_burst: Option<S<u64>>,
    tpm_burst: Option<S<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    name: S<String>,
    plan: S<String>,
    weight: Option<S<u64>>,
    #[serde(default)]
    key: Vec<BTreeMap<String, S<String>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAccount {
    name: S<String>,
    base_url: S<String>,
    api_key: S<String>,
    rpm: S<u64>,
    tpm: S<u64>,
    window: Option<S<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDemo {
    seconds: Option<S<u64>>,
    tolerance: Option<S<f64>>,
    #[serde(default)]
    client: Vec<RawClient>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClient {
    key: S<String>,
    batch: S<u64>,
    words: S<u64>,
    concurrency: S<u64>,
}

// ---------------------------------------------------------------------------------------
// Parsing and validation.

/// Tells positions in the text as lines and columns.
struct Source<'a> {
    text: &'a str,
    file: Option<String>,
}

impl Source<'_> {
    fn error(&self, span: Option<Range<usize>>, field: impl Into<String>, message: impl Into<String>) -> ConfigError {
        let (line, column) = match span {
            Some(span) => {
                let (l, c) = line_column(self.text, span.start);
                (Some(l), Some(c))
            }
            None => (None, None),
        };
        ConfigError { file: self.file.clone(), line, column, field: field.into(), message: message.into() }
    }

    fn at<T>(&self, value: &S<T>, field: impl Into<String>, message: impl Into<String>) -> ConfigError {
        self.error(Some(value.span()), field, message)
    }
}

/// The 1-based line and column (in characters) of byte `offset` in `text`.
#[must_use]
pub fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

impl Config {
    /// Reads and validates the file at `path`.
    ///
    /// # Errors
    /// The file cannot be read, or its first problem, with field and line.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: Some(name.clone()),
            line: None,
            column: None,
            field: String::new(),
            message: format!("cannot read it: {e}"),
        })?;
        Self::parse(&text, Some(&name))
    }

    /// Parses and validates `text`; `file` names it in errors.
    ///
    /// # Errors
    /// Its first problem, with field and line.
    pub fn parse(text: &str, file: Option<&str>) -> Result<Self, ConfigError> {
        let src = Source { text, file: file.map(str::to_owned) };
        let de = toml::Deserializer::parse(text).map_err(|e| match duplicate_key(text, e.message(), e.span()) {
            Some((field, message)) => src.error(e.span(), field, message),
            None => src.error(e.span(), "", e.message().to_owned()),
        })?;
        let raw: Raw = serde_path_to_error::deserialize(de).map_err(|e| {
            // Spanned values add a segment of their own to the path.
            let field = e.path().to_string();
            let field: Vec<&str> =
                field.split('.').filter(|s| !s.is_empty() && *s != "$__serde_spanned_private_value").collect();
            let field = field.join(".");
            let inner = e.into_inner();
            src.error(inner.span(), field, inner.message().to_owned())
        })?;
        validate(&src, raw)
    }
}

/// For TOML's "duplicate key" error, which points at the key without naming it: the key's
/// dotted path (under the table header above it) and a message naming it.
fn duplicate_key(text: &str, message: &str, span: Option<Range<usize>>) -> Option<(String, String)> {
    if !message.starts_with("duplicate key") {
        return None;
    }
    let span = span?;
    let key = text.get(span.clone())?.trim().trim_matches(|c| c == '"' || c == '\'');
    if key.is_empty() {
        return None;
    }
    // The table the key is in: the last header before it (`[gateway]`, `[[tenant]]`).
    let before = text.get(..span.start)?;
    let table = before
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|l| l.trim_start_matches('[').split(']').next().unwrap_or("").trim().to_owned());
    let field = match &table {
        // A key of the table's header line itself (`[plan.basic]` twice) names the table.
        Some(t) if !t.is_empty() && !t.ends_with(key) => format!("{t}.{key}"),
        Some(t) if !t.is_empty() => t.clone(),
        _ => key.to_owned(),
    };
    Some((field.clone(), format!("`{field}` is set twice (a key may appear once per table)")))
}

fn duration(src: &Source<'_>, value: &S<String>, field: &str) -> Result<Duration, ConfigError> {
    parse_duration(value.get_ref()).map_err(|e| src.at(value, field, e))
}

fn at_least(src: &Source<'_>, value: &S<u64>, field: &str, min: u64, max: u64) -> Result<u64, ConfigError> {
    let v = *value.get_ref();
    if v < min {
        return Err(src.at(value, field, format!("must be at least {min}")));
    }
    if v > max {
        return Err(src.at(value, field, format!("must be at most {max}")));
    }
    Ok(v)
}

fn address(src: &Source<'_>, value: &S<String>, field: &str) -> Result<SocketAddr, ConfigError> {
    value.get_ref().parse().map_err(|_| {
        src.at(value, field, format!("{:?} is not an address such as \"127.0.0.1:8080\"", value.get_ref()))
    })
}

#[allow(clippy::too_many_lines)] // one check after another, in the order of the file
fn validate(src: &Source<'_>, raw: Raw) -> Result<Config, ConfigError> {
    // Tiers.
    let tiers: Vec<String> = match &raw.tiers {
        None => ["org", "team", "user", "agent"].map(String::from).to_vec(),
        Some(t) => {
            if t.get_ref().is_empty() {
                return Err(src.at(t, "tiers", "name at least one tier"));
            }
            if t.get_ref().len() > tower_limits::core::MAX_TIERS {
                return Err(src.at(t, "tiers", format!("at most {} tiers", tower_limits::core::MAX_TIERS)));
            }
            let mut seen = HashSet::new();
            for (i, name) in t.get_ref().iter().enumerate() {
                let field = format!("tiers[{i}]");
                if name.get_ref().is_empty() || name.get_ref() == "key" || name.get_ref() == "global" {
                    return Err(src.at(name, field, "a tier needs a name other than \"key\" and \"global\""));
                }
                if !seen.insert(name.get_ref().clone()) {
                    return Err(src.at(name, field, format!("{:?} is named twice", name.get_ref())));
                }
            }
            t.get_ref().iter().map(|s| s.get_ref().clone()).collect()
        }
    };
    let tier_list = tiers.join(", ");

    // Gateway.
    let g = &raw.gateway;
    let listen = match &g.listen {
        Some(v) => address(src, v, "gateway.listen")?,
        None => SocketAddr::from(([127, 0, 0, 1], 8080)),
    };
    let max_wait = match &g.max_wait {
        Some(v) => duration(src, v, "gateway.max_wait")?,
        None => Duration::from_secs(5),
    };
    let max_request_tokens = match &g.max_request_tokens {
        Some(v) => at_least(src, v, "gateway.max_request_tokens", 1, 1 << 32)?,
        None => 8192,
    };
    let max_body_bytes = match &g.max_body_bytes {
        Some(v) => at_least(src, v, "gateway.max_body_bytes", 64, 1 << 30)? as usize,
        None => 1 << 20,
    };
    let fair_tier = match &g.fair_tier {
        Some(v) => {
            if !tiers.contains(v.get_ref()) {
                return Err(src.at(v, "gateway.fair_tier", format!("{:?} is not a tier ({tier_list})", v.get_ref())));
            }
            v.get_ref().clone()
        }
        None => tiers[0].clone(),
    };
    if fair_tier != tiers[0] {
        let v = g.fair_tier.as_ref().map(Spanned::span);
        return Err(src.error(v, "gateway.fair_tier", format!("tenants are the first tier ({:?}) for now", tiers[0])));
    }
    let tenant_queue = match &g.tenant_queue {
        Some(v) => at_least(src, v, "gateway.tenant_queue", 1, 1 << 20)? as usize,
        None => 64,
    };
    let queue = match &g.queue {
        Some(v) => at_least(src, v, "gateway.queue", 1, 1 << 20)? as usize,
        None => 1024,
    };
    let selection = match &g.selection {
        None => Selection::MostHeadroom,
        Some(v) => match v.get_ref().as_str() {
            "round_robin" => Selection::RoundRobin,
            "random" => Selection::Random,
            "most_headroom" => Selection::MostHeadroom,
            other => {
                return Err(src.at(
                    v,
                    "gateway.selection",
                    format!("{other:?} is not one of \"round_robin\", \"random\", \"most_headroom\""),
                ));
            }
        },
    };

    let models = match &g.models {
        None => vec!["mock-embedding-small".to_owned()],
        Some(list) => {
            if list.get_ref().is_empty() {
                return Err(src.at(list, "gateway.models", "name at least one model"));
            }
            let mut seen = HashSet::new();
            for (i, m) in list.get_ref().iter().enumerate() {
                if m.get_ref().trim().is_empty() {
                    return Err(src.at(m, format!("gateway.models[{i}]"), "must not be empty"));
                }
                if !seen.insert(m.get_ref().clone()) {
                    return Err(src.at(m, format!("gateway.models[{i}]"), format!("{:?} is named twice", m.get_ref())));
                }
            }
            list.get_ref().iter().map(|m| m.get_ref().clone()).collect()
        }
    };
    let positive = |v: &Option<S<String>>, field: &str, default: Duration| -> Result<Duration, ConfigError> {
        match v {
            None => Ok(default),
            Some(v) => {
                let d = duration(src, v, field)?;
                if d.is_zero() || d > Duration::from_secs(24 * 3600) {
                    return Err(src.at(v, field, "must be longer than zero and at most 24h"));
                }
                Ok(d)
            }
        }
    };
    let header_timeout = positive(&g.header_timeout, "gateway.header_timeout", Duration::from_secs(10))?;
    let idle_timeout = positive(&g.idle_timeout, "gateway.idle_timeout", Duration::from_secs(60))?;
    let body_timeout = positive(&g.body_timeout, "gateway.body_timeout", Duration::from_secs(30))?;
    let shutdown_grace = positive(&g.shutdown_grace, "gateway.shutdown_grace", Duration::from_secs(20))?;
    let upstream_timeout = positive(&g.upstream_timeout, "gateway.upstream_timeout", Duration::from_secs(30))?;
    let max_connections = match &g.max_connections {
        Some(v) => at_least(src, v, "gateway.max_connections", 1, 1 << 20)? as usize,
        None => 512,
    };
    let on_upstream_timeout = match &g.on_upstream_timeout {
        None => TimeoutCharge::Keep,
        Some(v) => match v.get_ref().as_str() {
            "keep" => TimeoutCharge::Keep,
            "refund" => TimeoutCharge::Refund,
            other => {
                return Err(src.at(
                    v,
                    "gateway.on_upstream_timeout",
                    format!("{other:?} is not \"keep\" or \"refund\""),
                ));
            }
        },
    };
    let backend_failure = match &g.backend_failure {
        None => BackendFailure::Fallback,
        Some(v) => match v.get_ref().as_str() {
            "fail_closed" => BackendFailure::FailClosed,
            "fail_open" => BackendFailure::FailOpen,
            "fallback" => BackendFailure::Fallback,
            other => {
                return Err(src.at(
                    v,
                    "gateway.backend_failure",
                    format!("{other:?} is not one of \"fail_closed\", \"fail_open\", \"fallback\""),
                ));
            }
        },
    };

    // Mirror.
    let jitter = match &raw.mirror.jitter {
        Some(v) => duration(src, v, "mirror.jitter")?,
        None => Duration::from_millis(100),
    };
    let burst_percent = match &raw.mirror.burst_percent {
        Some(v) => at_least(src, v, "mirror.burst_percent", 1, 90)?,
        None => 10,
    };
    let mirror = MirrorSettings { jitter, burst_percent };

    // Upstream (mock).
    let u = &raw.upstream;
    let upstream = UpstreamSettings {
        listen: match &u.listen {
            Some(v) => address(src, v, "upstream.listen")?,
            None => SocketAddr::from(([127, 0, 0, 1], 9100)),
        },
        dimensions: match &u.dimensions {
            Some(v) => at_least(src, v, "upstream.dimensions", 1, 4096)? as usize,
            None => 16,
        },
        latency: match &u.latency {
            Some(v) => duration(src, v, "upstream.latency")?,
            None => Duration::ZERO,
        },
    };

    // Plans.
    if raw.plan.is_empty() {
        return Err(src.error(None, "plan", "define at least one plan ([plan.NAME] with limits per tier)"));
    }
    let mut plans = Vec::new();
    for (name, by_tier) in &raw.plan {
        let mut policy = LimitSetPolicy::new().tiers(tiers.iter().cloned());
        for (tier, limits) in by_tier {
            let base = format!("plan.{name}.{tier}");
            if !tiers.contains(tier) {
                return Err(src.at(limits, base, format!("{tier:?} is not a tier ({tier_list})")));
            }
            let limits = limits.get_ref();
            let t = tier.as_str();
            let burst = |b: &Option<S<u64>>, field: &str, rate: u64| -> Result<u64, ConfigError> {
                match b {
                    Some(v) => at_least(src, v, &format!("{base}.{field}"), 1, u64::MAX >> 2),
                    // A tenth of a minute's worth, at least one.
                    None => Ok(rate.div_ceil(10).max(1)),
                }
            };
            if let Some(rpm) = &limits.rpm {
                let rate = at_least(src, rpm, &format!("{base}.rpm"), 1, 1 << 40)?;
                let b = burst(&limits.rpm_burst, "rpm_burst", rate)?;
                policy = policy.limit(LimitPolicy::gcra(format!("{t}.rpm"), Rate::per_minute(rate), b).per(t));
            } else if let Some(b) = &limits.rpm_burst {
                return Err(src.at(b, format!("{base}.rpm_burst"), "a burst needs an `rpm`"));
            }
            if let Some(tpm) = &limits.tpm {
                let rate = at_least(src, tpm, &format!("{base}.tpm"), 1, 1 << 40)?;
                let b = burst(&limits.tpm_burst, "tpm_burst", rate)?;
                if b < max_request_tokens {
                    let span = limits.tpm_burst.as_ref().map_or_else(|| tpm.span(), Spanned::span);
                    return Err(src.error(
                        Some(span),
                        format!("{base}.tpm_burst"),
                        format!(
                            "a burst of {b} tokens is below gateway.max_request_tokens ({max_request_tokens}): \
                             such requests could never pass (the default burst is a tenth of `tpm`)"
                        ),
                    ));
                }
                policy = policy
                    .limit(LimitPolicy::gcra(format!("{t}.tpm"), Rate::per_minute(rate), b).per(t).counting_cost());
            } else if let Some(b) = &limits.tpm_burst {
                return Err(src.at(b, format!("{base}.tpm_burst"), "a burst needs a `tpm`"));
            }
            if let Some(c) = &limits.concurrency {
                let c = at_least(src, c, &format!("{base}.concurrency"), 1, 1 << 20)?;
                policy = policy.limit(LimitPolicy::semaphore(format!("{t}.concurrency"), c).per(t));
            }
        }
        if let Err(e) = policy.validate() {
            let span = by_tier.values().next().map(Spanned::span);
            return Err(src.error(span, format!("plan.{name}"), e.to_string()));
        }
        plans.push(Plan { name: name.clone(), policy });
    }

    // Tenants and keys.
    if raw.tenant.is_empty() {
        return Err(src.error(None, "tenant", "define at least one [[tenant]]"));
    }
    let mut tenants = Vec::new();
    let mut names = HashMap::new();
    let mut secrets: HashMap<String, usize> = HashMap::new();
    for (i, t) in raw.tenant.iter().enumerate() {
        let base = format!("tenant[{i}]");
        let name = t.name.get_ref();
        if name.is_empty() {
            return Err(src.at(&t.name, format!("{base}.name"), "must not be empty"));
        }
        if let Some(first) = names.insert(name.clone(), t.name.span()) {
            let (line, _) = line_column(src.text, first.start);
            return Err(src.at(&t.name, format!("{base}.name"), format!("{name:?} is already a tenant (line {line})")));
        }
        let Some(plan) = plans.iter().position(|p| &p.name == t.plan.get_ref()) else {
            let known: Vec<&str> = plans.iter().map(|p| p.name.as_str()).collect();
            return Err(src.at(
                &t.plan,
                format!("{base}.plan"),
                format!("no plan is named {:?} (plans: {})", t.plan.get_ref(), known.join(", ")),
            ));
        };
        let weight = match &t.weight {
            Some(w) => at_least(src, w, &format!("{base}.weight"), 1, 1000)? as u32,
            None => 1,
        };
        if t.key.is_empty() {
            return Err(src.at(&t.name, format!("{base}.key"), "a tenant needs at least one [[tenant.key]]"));
        }
        let mut keys = Vec::new();
        for (j, k) in t.key.iter().enumerate() {
            let kbase = format!("{base}.key[{j}]");
            let mut secret = None;
            let mut parts: Vec<Option<&S<String>>> = vec![None; tiers.len()];
            // Keys and values share a line: a value's position stands for its key's.
            for (field, value) in k {
                if field == "key" {
                    secret = Some(value);
                } else if let Some(p) = tiers.iter().position(|t| t == field) {
                    if p == 0 {
                        return Err(src.at(
                            value,
                            format!("{kbase}.{field}"),
                            format!("the {:?} of a key is its tenant's name; leave it out", tiers[0]),
                        ));
                    }
                    parts[p] = Some(value);
                } else {
                    return Err(src.at(
                        value,
                        format!("{kbase}.{field}"),
                        format!("unknown field: expected `key` or a tier below {:?} ({tier_list})", tiers[0]),
                    ));
                }
            }
            // The table's own position is not kept; its first field stands for it.
            let first_span = k.values().next().map(Spanned::span);
            let Some(secret) = secret else {
                return Err(src.error(first_span, format!("{kbase}.key"), "missing field `key` (the API key)"));
            };
            if secret.get_ref().len() < 8 || secret.get_ref().chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(src.at(
                    secret,
                    format!("{kbase}.key"),
                    "an API key has at least 8 characters and no spaces",
                ));
            }
            if let Some(other) = secrets.insert(secret.get_ref().clone(), i) {
                return Err(src.at(
                    secret,
                    format!("{kbase}.key"),
                    format!("this key already belongs to tenant {:?}", raw.tenant[other].name.get_ref()),
                ));
            }
            let mut path = vec![name.clone()];
            for (p, part) in parts.iter().enumerate().skip(1) {
                match part {
                    Some(v) if !v.get_ref().is_empty() => path.push(v.get_ref().clone()),
                    Some(v) => return Err(src.at(*v, format!("{kbase}.{}", tiers[p]), "must not be empty")),
                    None => {
                        return Err(src.error(
                            first_span.clone(),
                            format!("{kbase}.{}", tiers[p]),
                            format!("missing: every key names each tier below {:?} ({tier_list})", tiers[0]),
                        ));
                    }
                }
            }
            let tenant_key = TenantKey::new(&path).map_err(|e| src.at(secret, &kbase, e.to_string()))?;
            keys.push(ApiKey { secret: secret.get_ref().clone(), tenant_key });
        }
        tenants.push(Tenant { name: name.clone(), plan, weight, keys });
    }

    // Accounts.
    if raw.account.is_empty() {
        return Err(src.error(None, "account", "define at least one upstream [[account]]"));
    }
    let mut accounts = Vec::new();
    for (i, a) in raw.account.iter().enumerate() {
        let base = format!("account[{i}]");
        if accounts.iter().any(|b: &Account| &b.name == a.name.get_ref()) {
            return Err(src.at(
                &a.name,
                format!("{base}.name"),
                format!("{:?} is already an account", a.name.get_ref()),
            ));
        }
        let url = a.base_url.get_ref().trim_end_matches('/');
        if !url.starts_with("http://") || url.parse::<http::Uri>().is_err() {
            return Err(src.at(
                &a.base_url,
                format!("{base}.base_url"),
                "expected a URL such as \"http://127.0.0.1:9100\" (no TLS)",
            ));
        }
        let window = match &a.window {
            Some(v) => duration(src, v, &format!("{base}.window"))?,
            None => Duration::from_secs(60),
        };
        if window.is_zero() || window > Duration::from_secs(60) {
            let span = a.window.as_ref().map(Spanned::span);
            return Err(src.error(span, format!("{base}.window"), "must be longer than zero and at most 1m"));
        }
        let account = Account {
            name: a.name.get_ref().clone(),
            base_url: url.to_owned(),
            api_key: a.api_key.get_ref().clone(),
            rpm: at_least(src, &a.rpm, &format!("{base}.rpm"), 1, 1 << 40)?,
            tpm: at_least(src, &a.tpm, &format!("{base}.tpm"), 1, 1 << 40)?,
            window,
        };
        let mirrored = account
            .mirror_policy(&mirror, max_request_tokens, 1)
            .and_then(|p| p.validate().map(|()| p).map_err(|e| format!("its mirror cannot be built: {e}")));
        if let Err(e) = mirrored {
            let at = if e.contains("requests per") { &a.rpm } else { &a.tpm };
            let field = if e.contains("requests per") { "rpm" } else { "tpm" };
            return Err(src.at(at, format!("{base}.{field}"), e));
        }
        accounts.push(account);
    }

    // Demo.
    let d = &raw.demo;
    let seconds = match &d.seconds {
        Some(v) => at_least(src, v, "demo.seconds", 1, 600)?,
        None => 10,
    };
    let tolerance = match &d.tolerance {
        Some(v) => {
            let t = *v.get_ref();
            if !(t > 0.0 && t < 1.0) {
                return Err(src.at(v, "demo.tolerance", "must be between 0 and 1"));
            }
            t
        }
        None => 0.05,
    };
    let mut clients = Vec::new();
    for (i, c) in d.client.iter().enumerate() {
        let base = format!("demo.client[{i}]");
        if !secrets.contains_key(c.key.get_ref()) {
            return Err(src.at(&c.key, format!("{base}.key"), "no tenant has this key"));
        }
        clients.push(DemoClient {
            key: c.key.get_ref().clone(),
            batch: at_least(src, &c.batch, &format!("{base}.batch"), 1, 2048)? as usize,
            words: at_least(src, &c.words, &format!("{base}.words"), 1, 10_000)? as usize,
            concurrency: at_least(src, &c.concurrency, &format!("{base}.concurrency"), 1, 256)? as usize,
        });
    }

    Ok(Config {
        tiers,
        gateway: GatewaySettings {
            listen,
            max_wait,
            max_request_tokens,
            max_body_bytes,
            fair_tier,
            tenant_queue,
            queue,
            selection,
            models,
            header_timeout,
            idle_timeout,
            body_timeout,
            max_connections,
            shutdown_grace,
            upstream_timeout,
            on_upstream_timeout,
            backend_failure,
        },
        mirror,
        upstream,
        plans,
        tenants,
        accounts,
        demo: DemoSettings { seconds, tolerance, clients },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_and_columns() {
        let text = "a = 1\nbé = 2\n";
        assert_eq!(line_column(text, 0), (1, 1));
        assert_eq!(line_column(text, 6), (2, 1));
        assert_eq!(line_column(text, 9), (2, 3));
    }

    #[test]
    fn per_window_quotas() {
        let a = Account {
            name: "a".into(),
            base_url: "http://x".into(),
            api_key: "k".into(),
            rpm: 1500,
            tpm: 300_000,
            window: Duration::from_secs(1),
        };
        assert_eq!((a.requests_per_window(), a.tokens_per_window()), (25, 5000));
    }
}
