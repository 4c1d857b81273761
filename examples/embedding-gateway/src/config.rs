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

use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use tower_limits::{LimitPolicy, LimitSetPolicy, Quota, Selection, TenantKey};

mod bands;
mod budgets;
mod raw;
mod validate;

pub use budgets::{Budget, Budgets, ModelPrice};
use raw::{Raw, S};
use validate::validate;

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
    /// The budgets in money of the plans' tiers, with the models' prices (`None`: no plan
    /// has a budget).
    pub budgets: Option<Budgets>,
    /// The upstream provider's accounts the gateway spreads requests over.
    pub accounts: Vec<Account>,
    /// The demo's clients.
    pub demo: DemoSettings,
}

/// How the gateway serves.
#[derive(Debug, Clone)]
pub struct GatewaySettings {
    /// How often one client address may fail authentication (a missing or unknown key):
    /// beyond it, every request from the address is answered `429` until the budget
    /// refills. `None` turns it off.
    pub auth_failures: Option<tower_limits::Quota>,
    /// Where `serve` listens.
    pub listen: SocketAddr,
    /// The longest a request waits in the fair queue for upstream capacity before a 503.
    pub max_wait: Duration,
    /// The most tokens one request may carry, prompt and reserved completion (above it:
    /// `400 context_length_exceeded` at once, counted no further than the limit).
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
    /// The models `POST /v1/embeddings` serves (`gateway.embedding_models`; others: `404`).
    pub embedding_models: Vec<String>,
    /// The models `POST /v1/chat/completions` serves (`gateway.chat_models`; others:
    /// `404`).
    pub chat_models: Vec<String>,
    /// The encoding each served model counts tokens with (`gateway.encodings`, or known
    /// from the model's name; see [`crate::tokenizer`]), and what an image in a chat
    /// message is charged (`gateway.image_tokens`).
    pub encodings: crate::tokenizer::ModelEncodings,
    /// The tokens a chat request without `max_tokens` reserves for its answer
    /// (`gateway.default_max_tokens`); `None`: whatever `max_request_tokens` leaves of
    /// the prompt. Below the model's real maximum it is an estimate, not a bound: a
    /// longer answer settles to its usage afterwards.
    pub default_max_tokens: Option<u64>,
    /// How long a client has to send a request's headers once its connection is open, or
    /// once it sent the first byte of the next request.
    pub header_timeout: Duration,
    /// How long a keep-alive connection may sit idle between requests.
    pub idle_timeout: Duration,
    /// How long a client has to send a request's body once its headers arrived (`408`).
    pub body_timeout: Duration,
    /// The slowest a body may arrive, in bytes a second on average once `body_grace` has
    /// passed (`408` when it falls behind); 0 for no minimum.
    pub body_min_rate: u64,
    /// How far behind `body_min_rate` a body may fall: the time its first bytes may take.
    pub body_grace: Duration,
    /// Bodies one tenant may be sending at once; beyond them its requests are answered
    /// `429` before their bodies are read.
    pub uploads_per_tenant: u64,
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
    /// The longest a call to Redis may take before the failure policy decides (250 ms: a
    /// loopback or LAN Redis on a busy machine; longer across zones).
    pub redis_timeout: Duration,
    /// With Redis: how often a replica renews its lease of the upstream accounts, deciding
    /// every request from it with no round trip; zero (the default) asks Redis for every
    /// request instead. A lease lives ten periods, at least two periods and
    /// `redis_timeout`. Each replica's lease holds the part of every mirror's burst that
    /// holds its largest recent request; a larger one waits for the next refreshes to
    /// grow it. Learned quotas reach every replica at its next refresh.
    pub account_lease_refresh: Duration,
    /// With Redis: how often a replica renews its shares of the tenants' plans (their rates
    /// and concurrency), deciding the requests of busy tenants from them with no round trip;
    /// zero (the default) asks Redis for every request instead. A share lives ten periods, at
    /// least two periods and `redis_timeout`. A tenant with fewer than four requests in a
    /// period takes from a pool in Redis, one call per request. The fleet still admits at
    /// most each limit's burst plus its rate over every window (the Redis guide's "Capacity
    /// shares").
    pub plan_share_refresh: Duration,
    /// The fair queue's priority bands, the first going first, each with the minimum
    /// share it keeps while it has requests waiting (none: one band).
    pub bands: Vec<tower_limits::core::fair_queue::BandConfig>,
    /// The header a client may name a band in, at or below its tenant's own band (none:
    /// clients cannot choose).
    pub band_header: Option<http::HeaderName>,
    /// How much later than the exact wait a refusal's `Retry-After` may say, in percent
    /// of the wait, drawn afresh per refusal: clients refused at one moment come back
    /// spread out rather than together (OpenAI's SDKs wait exactly `retry-after-ms`).
    /// 0 for the exact wait.
    pub retry_spread_percent: u16,
}

impl GatewaySettings {
    /// Every model served, embedding models first, each once: what `GET /v1/models` lists.
    #[must_use]
    pub fn models(&self) -> Vec<String> {
        let mut all = self.embedding_models.clone();
        all.extend(self.chat_models.iter().filter(|m| !self.embedding_models.contains(m)).cloned());
        all
    }
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
    /// How high the accounts' limits learned from the upstream's answers may go, in
    /// percent of the declared ones (100: learning only lowers, and recovers up to what
    /// was declared; 0: no learning).
    pub learn_ceiling_percent: u32,
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
    /// Its limit set (empty for a plan of budgets alone: see [`Config::budgets`]).
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
    /// Its band in the fair queue: an index into `gateway.bands` (0 when there are none).
    pub band: usize,
    /// Its API keys.
    pub keys: Vec<ApiKey>,
}

/// One API key, kept as its SHA-256 digest, and the tenant key it stands for.
#[derive(Debug, Clone)]
pub struct ApiKey {
    /// The digest of the bearer token: the configuration may give the token
    /// (`key = "sk-..."`) or only its digest (`key_sha256 = "<64 hex digits>"`), and the
    /// gateway keeps nothing else.
    pub digest: KeyDigest,
    /// Whether the configuration wrote the key itself rather than its digest (`check`
    /// warns about those).
    pub plain: bool,
    /// The tiers it maps to.
    pub tenant_key: TenantKey,
}

/// The SHA-256 digest of an API key: what the gateway keeps and looks keys up by, so that
/// neither its memory nor a configuration written with `key_sha256` holds the keys.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyDigest(pub [u8; 32]);

impl KeyDigest {
    /// The digest of `key`.
    ///
    /// ```
    /// use embedding_gateway::config::KeyDigest;
    ///
    /// // As `printf %s sk-acme | sha256sum` prints it.
    /// let digest = KeyDigest::of("sk-acme");
    /// assert_eq!(digest.to_hex(), "5f8eee912cd7c0ccb238560e8a22e7f78909e6dac18288188f7f4ea35112700d");
    /// assert_eq!(KeyDigest::from_hex(&digest.to_hex()), Some(digest));
    /// ```
    #[must_use]
    pub fn of(key: &str) -> Self {
        use sha2::Digest;
        KeyDigest(sha2::Sha256::digest(key.as_bytes()).into())
    }

    /// The digest written as 64 lowercase hexadecimal digits, as `sha256sum` prints it.
    #[must_use]
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A digest written as 64 hexadecimal digits.
    #[must_use]
    pub fn from_hex(text: &str) -> Option<Self> {
        let bytes = text.as_bytes();
        if bytes.len() != 64 || !text.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks(2).enumerate() {
            out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
        }
        Some(KeyDigest(out))
    }
}

impl std::fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A digest is no secret, but eight digits name it well enough.
        write!(f, "KeyDigest({}..)", &self.to_hex()[..8])
    }
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
    /// The quota (or its share) is too small for that burst, or its mirror is too fast
    /// or its burst too long to represent; the message says "requests per" or "tokens
    /// per", for the field it is about.
    pub fn mirror_policy(
        &self,
        mirror: &MirrorSettings,
        max_request_tokens: u64,
        replicas: u64,
    ) -> Result<LimitSetPolicy, String> {
        self.mirror_policy_for(
            self.requests_per_window(),
            self.tokens_per_window(),
            mirror,
            max_request_tokens,
            replicas,
        )
    }

    /// As [`Account::mirror_policy`], for quotas of `requests` and `tokens` per window
    /// rather than the declared ones: what the mirror becomes once the account's real
    /// limits are learned.
    ///
    /// # Errors
    /// As [`Account::mirror_policy`].
    pub fn mirror_policy_for(
        &self,
        requests: u64,
        tokens: u64,
        mirror: &MirrorSettings,
        max_request_tokens: u64,
        replicas: u64,
    ) -> Result<LimitSetPolicy, String> {
        let period = self.window + mirror.jitter;
        let window = tower_limits::core::policy::format_duration(self.window);
        let share = |quota: u64, at_least: u64, what: &str| {
            let l = quota / replicas.max(1);
            let b = mirror_burst(l, mirror, at_least);
            let of = if replicas > 1 { format!(" ({replicas} replicas' share)") } else { String::new() };
            if b >= l {
                return Err(format!(
                    "{l} {what} per {window} window{of} leave no room for a burst of {b} \
                     (mirror.burst_percent, gateway.max_request_tokens): raise it or lengthen `window`"
                ));
            }
            Quota::try_new(l - b, period)
                .and_then(|q| q.try_burst(b))
                .map_err(|e| format!("the mirror of {l} {what} per {window} window{of} cannot be built: {e}"))
        };
        let rpm = share(requests, 1, "requests")?;
        let tpm = share(tokens, max_request_tokens, "tokens")?;
        Ok(LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("upstream.rpm", rpm))
            .limit(LimitPolicy::gcra("upstream.tpm", tpm).counting_cost()))
    }
}

fn per_window(per_minute: u64, window: Duration) -> u64 {
    (u128::from(per_minute) * window.as_nanos() / 60_000_000_000) as u64
}

impl Config {
    /// The time the upstream accounts take per request when they are what binds: one
    /// interval of their mirrors' request rates together, for a replica of `replicas`.
    /// Zero without accounts.
    #[must_use]
    pub fn upstream_spacing(&self, replicas: u64) -> Duration {
        let per_second: f64 = self
            .accounts
            .iter()
            .map(|a| {
                let l = a.requests_per_window() / replicas.max(1);
                let steady = l.saturating_sub(mirror_burst(l, &self.mirror, 1));
                steady as f64 / (a.window + self.mirror.jitter).as_secs_f64()
            })
            .sum();
        if per_second > 0.0 { Duration::from_secs_f64(1.0 / per_second) } else { Duration::ZERO }
    }
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
