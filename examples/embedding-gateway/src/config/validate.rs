//! Validation of the raw form into the typed [`Config`]: one check after another, in
//! the order of the file, each error naming the field and where it was written.
//!
//! [`validate`] reads the sections in that order, one function per section; the first
//! error stops it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::ops::Range;
use std::time::Duration;

use toml::Spanned;
use tower_limits::core::policy::parse_duration;
use tower_limits::{LimitPolicy, LimitSetPolicy, Quota, Selection, TenantKey};

use crate::tokenizer::{ENCODING_NAMES, Encoding, ModelEncodings, UnknownEncoding};

use super::raw::{Raw, RawAccount, RawDemo, RawGateway, RawMirror, RawTenant, RawTierLimits, RawUpstream, S};
use super::{
    Account, ApiKey, BackendFailure, Config, ConfigError, DemoClient, DemoSettings, GatewaySettings, KeyDigest,
    MirrorSettings, Plan, Source, Tenant, TimeoutCharge, UpstreamSettings, line_column,
};

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

/// A duration longer than zero and at most a day; `default` when `value` is left out.
fn positive_duration(
    src: &Source<'_>,
    value: Option<&S<String>>,
    field: &str,
    default: Duration,
) -> Result<Duration, ConfigError> {
    let Some(v) = value else { return Ok(default) };
    let d = duration(src, v, field)?;
    if d.is_zero() || d > Duration::from_secs(24 * 3600) {
        return Err(src.at(v, field, "must be longer than zero and at most 24h"));
    }
    Ok(d)
}

/// The choice that `value` names among `choices` (each as written in the file, and what
/// it stands for); `default` when `value` is left out.
fn choice<T: Copy>(
    src: &Source<'_>,
    value: Option<&S<String>>,
    field: &str,
    choices: &[(&str, T)],
    default: T,
) -> Result<T, ConfigError> {
    let Some(v) = value else { return Ok(default) };
    if let Some((_, chosen)) = choices.iter().find(|(name, _)| *name == v.get_ref().as_str()) {
        return Ok(*chosen);
    }
    let names: Vec<String> = choices.iter().map(|(name, _)| format!("{name:?}")).collect();
    let expected = match names.as_slice() {
        [first, second] => format!("{first} or {second}"),
        _ => format!("one of {}", names.join(", ")),
    };
    Err(src.at(v, field, format!("{:?} is not {expected}", v.get_ref())))
}

/// Validates `raw` into a [`Config`], section by section in the order of the file.
pub(super) fn validate(src: &Source<'_>, raw: Raw) -> Result<Config, ConfigError> {
    let tiers = tiers(src, raw.tiers.as_ref())?;
    let gateway = gateway(src, &raw.gateway, &tiers)?;
    let mirror = mirror(src, &raw.mirror)?;
    let upstream = upstream(src, &raw.upstream)?;
    let plans = plans(src, &raw.plan, &tiers, gateway.max_request_tokens)?;
    let models = gateway.models();
    let budgets = super::budgets::budgets(src, &raw.price, &raw.plan, raw.gateway.timezone.as_ref(), &tiers, &models)?;
    let tenants = tenants(src, &raw.tenant, &tiers, &plans, &gateway.bands)?;
    let accounts = accounts(src, &raw.account, &mirror, gateway.max_request_tokens)?;
    let demo = demo(src, &raw.demo, &tenants)?;
    Ok(Config { tiers, gateway, mirror, upstream, plans, tenants, budgets, accounts, demo })
}

/// The tiers, broadest first: `org`, `team`, `user`, `agent` when left out.
fn tiers(src: &Source<'_>, raw: Option<&S<Vec<S<String>>>>) -> Result<Vec<String>, ConfigError> {
    let Some(t) = raw else {
        return Ok(["org", "team", "user", "agent"].map(String::from).to_vec());
    };
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
    Ok(t.get_ref().iter().map(|s| s.get_ref().clone()).collect())
}

/// The `[gateway]` section.
fn gateway(src: &Source<'_>, g: &RawGateway, tiers: &[String]) -> Result<GatewaySettings, ConfigError> {
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
    let fair_tier = fair_tier(src, g.fair_tier.as_ref(), tiers)?;
    let tenant_queue = match &g.tenant_queue {
        Some(v) => at_least(src, v, "gateway.tenant_queue", 1, 1 << 20)? as usize,
        None => 64,
    };
    let queue = match &g.queue {
        Some(v) => at_least(src, v, "gateway.queue", 1, 1 << 20)? as usize,
        None => 1024,
    };
    let selection = choice(
        src,
        g.selection.as_ref(),
        "gateway.selection",
        &[
            ("round_robin", Selection::RoundRobin),
            ("random", Selection::Random),
            ("most_headroom", Selection::MostHeadroom),
        ],
        Selection::MostHeadroom,
    )?;
    if let Some(old) = &g.models {
        return Err(src.at(
            old,
            "gateway.models",
            "models are listed by kind: `embedding_models` for /v1/embeddings, `chat_models` for \
             /v1/chat/completions",
        ));
    }
    let embedding_models =
        models(src, g.embedding_models.as_ref(), "gateway.embedding_models", "mock-embedding-small")?;
    let chat_models = models(src, g.chat_models.as_ref(), "gateway.chat_models", "mock-chat-small")?;
    let image_tokens = match &g.image_tokens {
        Some(v) => at_least(src, v, "gateway.image_tokens", 0, 1 << 24)?,
        None => crate::tokenizer::DEFAULT_IMAGE_TOKENS,
    };
    let encodings = encodings(src, g, &embedding_models, &chat_models)?.with_image_tokens(image_tokens);
    let default_max_tokens = match &g.default_max_tokens {
        Some(v) if *v.get_ref() >= max_request_tokens => {
            return Err(src.at(
                v,
                "gateway.default_max_tokens",
                format!("must be below gateway.max_request_tokens ({max_request_tokens}), to leave room for a prompt"),
            ));
        }
        Some(v) => Some(at_least(src, v, "gateway.default_max_tokens", 1, 1 << 32)?),
        None => None,
    };
    let positive =
        |v: &Option<S<String>>, field: &str, default: Duration| positive_duration(src, v.as_ref(), field, default);
    let header_timeout = positive(&g.header_timeout, "gateway.header_timeout", Duration::from_secs(10))?;
    let idle_timeout = positive(&g.idle_timeout, "gateway.idle_timeout", Duration::from_secs(60))?;
    let body_timeout = positive(&g.body_timeout, "gateway.body_timeout", Duration::from_secs(30))?;
    let body_grace = positive(&g.body_grace, "gateway.body_grace", Duration::from_secs(5))?;
    let body_min_rate = match &g.body_min_rate {
        Some(v) => at_least(src, v, "gateway.body_min_rate", 0, 1 << 40)?,
        None => 1024,
    };
    let uploads_per_tenant = match &g.uploads_per_tenant {
        Some(v) => at_least(src, v, "gateway.uploads_per_tenant", 1, 1 << 20)?,
        None => 8,
    };
    let shutdown_grace = positive(&g.shutdown_grace, "gateway.shutdown_grace", Duration::from_secs(20))?;
    let upstream_timeout = positive(&g.upstream_timeout, "gateway.upstream_timeout", Duration::from_secs(30))?;
    let redis_timeout = positive(&g.redis_timeout, "gateway.redis_timeout", Duration::from_millis(250))?;
    let refresh = |v: Option<&S<String>>, field: &'static str, off: &str| match v {
        Some(v) => {
            let d = duration(src, v, field)?;
            if d > Duration::from_secs(60) {
                return Err(src.at(v, field, format!("must be at most 60s (0s: {off})")));
            }
            Ok(d)
        }
        None => Ok(Duration::ZERO),
    };
    let account_lease_refresh =
        refresh(g.account_lease_refresh.as_ref(), "gateway.account_lease_refresh", "no leases")?;
    let plan_share_refresh = refresh(g.plan_share_refresh.as_ref(), "gateway.plan_share_refresh", "no shares")?;
    let max_connections = match &g.max_connections {
        Some(v) => at_least(src, v, "gateway.max_connections", 1, 1 << 20)? as usize,
        None => 512,
    };
    let on_upstream_timeout = choice(
        src,
        g.on_upstream_timeout.as_ref(),
        "gateway.on_upstream_timeout",
        &[("keep", TimeoutCharge::Keep), ("refund", TimeoutCharge::Refund)],
        TimeoutCharge::Keep,
    )?;
    let backend_failure = choice(
        src,
        g.backend_failure.as_ref(),
        "gateway.backend_failure",
        &[
            ("fail_closed", BackendFailure::FailClosed),
            ("fail_open", BackendFailure::FailOpen),
            ("fallback", BackendFailure::Fallback),
        ],
        BackendFailure::Fallback,
    )?;
    let auth_failures = auth_failures(src, g)?;
    let retry_spread_percent = match &g.retry_spread_percent {
        Some(v) => at_least(src, v, "gateway.retry_spread_percent", 0, 1000)? as u16,
        None => 25,
    };
    let (bands, band_header) = super::bands::bands(src, g)?;
    Ok(GatewaySettings {
        bands,
        band_header,
        retry_spread_percent,
        redis_timeout,
        account_lease_refresh,
        plan_share_refresh,
        auth_failures,
        listen,
        max_wait,
        max_request_tokens,
        max_body_bytes,
        fair_tier,
        tenant_queue,
        queue,
        selection,
        embedding_models,
        chat_models,
        encodings,
        default_max_tokens,
        header_timeout,
        idle_timeout,
        body_timeout,
        body_min_rate,
        body_grace,
        uploads_per_tenant,
        max_connections,
        shutdown_grace,
        upstream_timeout,
        on_upstream_timeout,
        backend_failure,
    })
}

/// `gateway.auth_failures_per_minute` (30 by default, 0 for none) and
/// `gateway.auth_failure_burst` (10): what one client address may fail authentication.
fn auth_failures(src: &Source<'_>, g: &RawGateway) -> Result<Option<Quota>, ConfigError> {
    let per_minute = match &g.auth_failures_per_minute {
        Some(v) => at_least(src, v, "gateway.auth_failures_per_minute", 0, 1 << 20)?,
        None => 30,
    };
    let burst = match &g.auth_failure_burst {
        Some(v) => at_least(src, v, "gateway.auth_failure_burst", 1, 1 << 20)?,
        None => 10,
    };
    let Some(per_minute) = std::num::NonZeroU64::new(per_minute) else { return Ok(None) };
    let Some(burst) = std::num::NonZeroU64::new(burst) else { return Ok(None) };
    Ok(Some(Quota::per_minute(per_minute).burst(burst)))
}

/// `gateway.fair_tier`: one of the tiers, and for now the first (the default).
fn fair_tier(src: &Source<'_>, value: Option<&S<String>>, tiers: &[String]) -> Result<String, ConfigError> {
    let fair_tier = match value {
        Some(v) => {
            if !tiers.contains(v.get_ref()) {
                let tier_list = tiers.join(", ");
                return Err(src.at(v, "gateway.fair_tier", format!("{:?} is not a tier ({tier_list})", v.get_ref())));
            }
            v.get_ref().clone()
        }
        None => tiers[0].clone(),
    };
    if fair_tier != tiers[0] {
        let v = value.map(Spanned::span);
        return Err(src.error(v, "gateway.fair_tier", format!("tenants are the first tier ({:?}) for now", tiers[0])));
    }
    Ok(fair_tier)
}

/// `field` (`gateway.embedding_models` or `gateway.chat_models`): at least one, none
/// empty or named twice (`default` alone when absent).
fn models(
    src: &Source<'_>,
    value: Option<&S<Vec<S<String>>>>,
    field: &str,
    default: &str,
) -> Result<Vec<String>, ConfigError> {
    let Some(list) = value else { return Ok(vec![default.to_owned()]) };
    if list.get_ref().is_empty() {
        return Err(src.at(list, field, "name at least one model"));
    }
    let mut seen = HashSet::new();
    for (i, m) in list.get_ref().iter().enumerate() {
        if m.get_ref().trim().is_empty() {
            return Err(src.at(m, format!("{field}[{i}]"), "must not be empty"));
        }
        if !seen.insert(m.get_ref().clone()) {
            return Err(src.at(m, format!("{field}[{i}]"), format!("{:?} is named twice", m.get_ref())));
        }
    }
    Ok(list.get_ref().iter().map(|m| m.get_ref().clone()).collect())
}

/// `gateway.encodings`: the encoding of each served model, from the table or else from
/// the model's name ([`Encoding::for_model`]); the default models (when the lists are
/// left out) are the mock provider's, counted with `cl100k_base`.
fn encodings(
    src: &Source<'_>,
    g: &RawGateway,
    embedding_models: &[String],
    chat_models: &[String],
) -> Result<ModelEncodings, ConfigError> {
    let empty = BTreeMap::new();
    let table = g.encodings.as_ref().map_or(&empty, |t| t.get_ref());
    let mut chosen = BTreeMap::new();
    for (model, name) in table {
        let field = format!("gateway.encodings.{model:?}");
        let encoding: Encoding =
            name.get_ref().parse().map_err(|e: UnknownEncoding| src.at(name, &field, e.to_string()))?;
        if !embedding_models.contains(model) && !chat_models.contains(model) {
            return Err(src.at(
                name,
                field,
                format!("{model:?} is not served: name it in gateway.embedding_models or gateway.chat_models"),
            ));
        }
        chosen.insert(model.clone(), encoding);
    }
    for (list, field) in [(&g.embedding_models, "gateway.embedding_models"), (&g.chat_models, "gateway.chat_models")] {
        let Some(list) = list else { continue };
        for (i, m) in list.get_ref().iter().enumerate() {
            let model = m.get_ref();
            if chosen.contains_key(model) {
                continue;
            }
            let Some(encoding) = Encoding::for_model(model) else {
                return Err(src.at(
                    m,
                    format!("{field}[{i}]"),
                    format!(
                        "{model:?} has no known encoding: name it under [gateway.encodings] ({:?} = one of {}; \
                         utf8_bytes counts one token per byte, an upper bound for any model)",
                        model,
                        ENCODING_NAMES.join(", ")
                    ),
                ));
            };
            chosen.insert(model.clone(), encoding);
        }
    }
    for model in embedding_models.iter().chain(chat_models) {
        chosen.entry(model.clone()).or_insert(Encoding::Cl100kBase);
    }
    Ok(ModelEncodings::new(chosen))
}

/// The `[mirror]` section.
fn mirror(src: &Source<'_>, m: &RawMirror) -> Result<MirrorSettings, ConfigError> {
    let jitter = match &m.jitter {
        Some(v) => duration(src, v, "mirror.jitter")?,
        None => Duration::ZERO,
    };
    let burst_percent = match &m.burst_percent {
        Some(v) => at_least(src, v, "mirror.burst_percent", 1, 90)?,
        None => 10,
    };
    let learn_ceiling_percent = match &m.learn_ceiling_percent {
        Some(v) if *v.get_ref() == 0 => 0,
        Some(v) => at_least(src, v, "mirror.learn_ceiling_percent", 100, 1000)? as u32,
        None => 100,
    };
    Ok(MirrorSettings { jitter, burst_percent, learn_ceiling_percent })
}

/// The `[upstream]` section (the mock upstream).
fn upstream(src: &Source<'_>, u: &RawUpstream) -> Result<UpstreamSettings, ConfigError> {
    Ok(UpstreamSettings {
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
    })
}

/// The `[plan.NAME.TIER]` sections: at least one plan.
fn plans(
    src: &Source<'_>,
    raw: &BTreeMap<String, BTreeMap<String, S<RawTierLimits>>>,
    tiers: &[String],
    max_request_tokens: u64,
) -> Result<Vec<Plan>, ConfigError> {
    if raw.is_empty() {
        return Err(src.error(None, "plan", "define at least one plan ([plan.NAME] with limits per tier)"));
    }
    let mut plans = Vec::new();
    for (name, by_tier) in raw {
        let mut policy = LimitSetPolicy::new().tiers(tiers.iter().cloned());
        for (tier, limits) in by_tier {
            policy = tier_limits(src, policy, &format!("plan.{name}.{tier}"), tier, limits, tiers, max_request_tokens)?;
        }
        // A plan of budgets alone has no other limit: its requests go on unlimited.
        let budgets_only = policy.limits.is_empty() && by_tier.values().any(|l| l.get_ref().budget.is_some());
        if let Err(e) = policy.validate().or_else(|e| if budgets_only { Ok(()) } else { Err(e) }) {
            let span = by_tier.values().next().map(Spanned::span);
            return Err(src.error(span, format!("plan.{name}"), e.to_string()));
        }
        plans.push(Plan { name: name.clone(), policy });
    }
    Ok(plans)
}

/// `policy` with the limits of one tier of a plan (`base`, as `plan.NAME.TIER`): its
/// RPM and TPM (each with its burst, a tenth of the rate by default) and its concurrency.
fn tier_limits(
    src: &Source<'_>,
    mut policy: LimitSetPolicy,
    base: &str,
    tier: &str,
    limits: &S<RawTierLimits>,
    tiers: &[String],
    max_request_tokens: u64,
) -> Result<LimitSetPolicy, ConfigError> {
    if !tiers.iter().any(|t| t == tier) {
        return Err(src.at(limits, base, format!("{tier:?} is not a tier ({})", tiers.join(", "))));
    }
    let limits = limits.get_ref();
    // `field` a minute, with the burst `field_burst` (a tenth of a minute's worth by
    // default, at least one), or the error naming the field at fault.
    let per_minute = |rate: &S<u64>, field: &str, burst: &Option<S<u64>>| -> Result<Quota, ConfigError> {
        let amount = at_least(src, rate, &format!("{base}.{field}"), 1, 1 << 40)?;
        let quota = Quota::try_new(amount, Duration::from_secs(60))
            .map_err(|e| src.at(rate, format!("{base}.{field}"), e.message()))?;
        match burst {
            Some(b) => {
                let field = format!("{base}.{field}_burst");
                quota.try_burst(at_least(src, b, &field, 1, u64::MAX >> 2)?).map_err(|e| src.at(b, field, e.message()))
            }
            // A tenth of the amount: it fits whenever the rate does.
            None => quota
                .try_burst(amount.div_ceil(10).max(1))
                .map_err(|e| src.at(rate, format!("{base}.{field}"), e.message())),
        }
    };
    if let Some(rpm) = &limits.rpm {
        let quota = per_minute(rpm, "rpm", &limits.rpm_burst)?;
        policy = policy.limit(LimitPolicy::gcra(format!("{tier}.rpm"), quota).per(tier));
    } else if let Some(b) = &limits.rpm_burst {
        return Err(src.at(b, format!("{base}.rpm_burst"), "a burst needs an `rpm`"));
    }
    if let Some(tpm) = &limits.tpm {
        let quota = per_minute(tpm, "tpm", &limits.tpm_burst)?;
        let b = quota.max_burst();
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
        policy = policy.limit(LimitPolicy::gcra(format!("{tier}.tpm"), quota).per(tier).counting_cost());
    } else if let Some(b) = &limits.tpm_burst {
        return Err(src.at(b, format!("{base}.tpm_burst"), "a burst needs a `tpm`"));
    }
    if let Some(c) = &limits.concurrency {
        let c = at_least(src, c, &format!("{base}.concurrency"), 1, 1 << 20)?;
        policy = policy.limit(LimitPolicy::semaphore(format!("{tier}.concurrency"), c).per(tier));
    }
    Ok(policy)
}

/// The `[[tenant]]` sections and their keys: at least one tenant, each with a name of its
/// own, a known plan and at least one key; no key given twice.
fn tenants(
    src: &Source<'_>,
    raw: &[RawTenant],
    tiers: &[String],
    plans: &[Plan],
    bands: &[tower_limits::core::fair_queue::BandConfig],
) -> Result<Vec<Tenant>, ConfigError> {
    if raw.is_empty() {
        return Err(src.error(None, "tenant", "define at least one [[tenant]]"));
    }
    let mut tenants = Vec::new();
    let mut names = HashMap::new();
    // Every key read so far, and the index of its tenant.
    let mut owners: HashMap<KeyDigest, usize> = HashMap::new();
    for (i, t) in raw.iter().enumerate() {
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
        let band = super::bands::tenant_band(src, t.band.as_ref(), &base, bands)?;
        if t.key.is_empty() {
            return Err(src.at(&t.name, format!("{base}.key"), "a tenant needs at least one [[tenant.key]]"));
        }
        let mut keys = Vec::new();
        for (j, k) in t.key.iter().enumerate() {
            let kbase = format!("{base}.key[{j}]");
            let fields = key_fields(src, k, &kbase, tiers)?;
            let (digest, written, field) = (fields.digest, fields.written, fields.field);
            if let Some(other) = owners.insert(digest, i) {
                return Err(src.at(
                    written,
                    format!("{kbase}.{field}"),
                    format!("this key already belongs to tenant {:?}", raw[other].name.get_ref()),
                ));
            }
            let tenant_key = key_tiers(src, fields, &kbase, name, tiers)?;
            keys.push(ApiKey { digest, plain: field == "key", tenant_key });
        }
        tenants.push(Tenant { name: name.clone(), plan, weight, band, keys });
    }
    Ok(tenants)
}

/// One `[[tenant.key]]` as written, before its tiers are checked.
struct KeyFields<'k> {
    /// The API key's digest.
    digest: KeyDigest,
    /// Where the key (or its digest) was written, and under which field.
    written: &'k S<String>,
    field: &'static str,
    /// The key's value at each tier, in the order of the tiers: `None` at the first (the
    /// tenant's name) and where it names none.
    parts: Vec<Option<&'k S<String>>>,
    /// Where the table was written: the table's own position is not kept, so its first
    /// field stands for it.
    at: Option<Range<usize>>,
}

/// Reads one `[[tenant.key]]` (`kbase`, as `tenant[I].key[J]`): no field but `key` and
/// the tiers below the first, and a well-formed API key.
fn key_fields<'k>(
    src: &Source<'_>,
    key: &'k BTreeMap<String, S<String>>,
    kbase: &str,
    tiers: &[String],
) -> Result<KeyFields<'k>, ConfigError> {
    let mut secret = None;
    let mut digest = None;
    let mut parts: Vec<Option<&S<String>>> = vec![None; tiers.len()];
    // Keys and values share a line: a value's position stands for its key's.
    for (field, value) in key {
        if field == "key" {
            secret = Some(value);
        } else if field == "key_sha256" {
            digest = Some(value);
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
                format!(
                    "unknown field: expected `key`, `key_sha256` or a tier below {:?} ({})",
                    tiers[0],
                    tiers.join(", ")
                ),
            ));
        }
    }
    let at = key.values().next().map(Spanned::span);
    let (digest, written, field) = match (secret, digest) {
        (Some(secret), None) => {
            let text = secret.get_ref();
            if text.len() < 8 || text.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(src.at(
                    secret,
                    format!("{kbase}.key"),
                    "an API key has at least 8 characters and no spaces",
                ));
            }
            (KeyDigest::of(text), secret, "key")
        }
        (None, Some(hex)) => match KeyDigest::from_hex(hex.get_ref()) {
            Some(d) => (d, hex, "key_sha256"),
            None => {
                return Err(src.at(
                    hex,
                    format!("{kbase}.key_sha256"),
                    "a SHA-256 digest is 64 hexadecimal digits (`printf %s \"$KEY\" | sha256sum`)",
                ));
            }
        },
        (Some(_), Some(hex)) => {
            return Err(src.at(hex, format!("{kbase}.key_sha256"), "give the key or its digest, not both"));
        }
        (None, None) => {
            return Err(src.error(
                at,
                format!("{kbase}.key"),
                "missing field `key` (the API key) or `key_sha256` (its SHA-256 digest)",
            ));
        }
    };
    Ok(KeyFields { digest, written, field, parts, at })
}

/// The tenant key that one `[[tenant.key]]` stands for: the tenant's `name`, then the
/// key's value at every further tier, none missing or empty.
fn key_tiers(
    src: &Source<'_>,
    fields: KeyFields<'_>,
    kbase: &str,
    name: &str,
    tiers: &[String],
) -> Result<TenantKey, ConfigError> {
    let mut path = vec![name.to_owned()];
    for (p, part) in fields.parts.iter().enumerate().skip(1) {
        match part {
            Some(v) if !v.get_ref().is_empty() => path.push(v.get_ref().clone()),
            Some(v) => return Err(src.at(*v, format!("{kbase}.{}", tiers[p]), "must not be empty")),
            None => {
                return Err(src.error(
                    fields.at,
                    format!("{kbase}.{}", tiers[p]),
                    format!("missing: every key names each tier below {:?} ({})", tiers[0], tiers.join(", ")),
                ));
            }
        }
    }
    TenantKey::new(&path).map_err(|e| src.at(fields.written, kbase, e.to_string()))
}

/// The `[[account]]` sections: at least one account, each with a name of its own, a
/// plain HTTP base URL, a window of at most a minute, and quotas its mirror can be built
/// from.
fn accounts(
    src: &Source<'_>,
    raw: &[RawAccount],
    mirror: &MirrorSettings,
    max_request_tokens: u64,
) -> Result<Vec<Account>, ConfigError> {
    if raw.is_empty() {
        return Err(src.error(None, "account", "define at least one upstream [[account]]"));
    }
    let mut accounts = Vec::new();
    for (i, a) in raw.iter().enumerate() {
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
            .mirror_policy(mirror, max_request_tokens, 1)
            .and_then(|p| p.validate().map(|()| p).map_err(|e| format!("its mirror cannot be built: {e}")));
        if let Err(e) = mirrored {
            let at = if e.contains("requests per") { &a.rpm } else { &a.tpm };
            let field = if e.contains("requests per") { "rpm" } else { "tpm" };
            return Err(src.at(at, format!("{base}.{field}"), e));
        }
        accounts.push(account);
    }
    Ok(accounts)
}

/// The `[demo]` section: its length, its tolerance and its clients, each sending the key
/// of one of `tenants`.
fn demo(src: &Source<'_>, d: &RawDemo, tenants: &[Tenant]) -> Result<DemoSettings, ConfigError> {
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
        let digest = KeyDigest::of(c.key.get_ref());
        if !tenants.iter().flat_map(|t| &t.keys).any(|k| k.digest == digest) {
            return Err(src.at(&c.key, format!("{base}.key"), "no tenant has this key"));
        }
        clients.push(DemoClient {
            key: c.key.get_ref().clone(),
            batch: at_least(src, &c.batch, &format!("{base}.batch"), 1, 2048)? as usize,
            words: at_least(src, &c.words, &format!("{base}.words"), 1, 10_000)? as usize,
            concurrency: at_least(src, &c.concurrency, &format!("{base}.concurrency"), 1, 256)? as usize,
        });
    }
    Ok(DemoSettings { seconds, tolerance, clients })
}
