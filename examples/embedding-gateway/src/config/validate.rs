//! Validation of the raw form into the typed [`Config`]: one check after another, in
//! the order of the file, each error naming the field and where it was written.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Duration;

use toml::Spanned;
use tower_limits::core::policy::parse_duration;
use tower_limits::{LimitPolicy, LimitSetPolicy, Rate, Selection, TenantKey};

use super::raw::{Raw, S};
use super::{
    Account, ApiKey, BackendFailure, Config, ConfigError, DemoClient, DemoSettings, GatewaySettings, MirrorSettings,
    Plan, Source, Tenant, TimeoutCharge, UpstreamSettings, line_column,
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

#[allow(clippy::too_many_lines)] // one check after another, in the order of the file
pub(super) fn validate(src: &Source<'_>, raw: Raw) -> Result<Config, ConfigError> {
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
