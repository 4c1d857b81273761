//! The configuration file's raw form, as written: every leaf a [`Spanned`] value, so
//! that validation still knows where each was written.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

pub(super) type S<T> = Spanned<T>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Raw {
    pub(super) tiers: Option<S<Vec<S<String>>>>,
    #[serde(default)]
    pub(super) gateway: RawGateway,
    #[serde(default)]
    pub(super) mirror: RawMirror,
    #[serde(default)]
    pub(super) upstream: RawUpstream,
    #[serde(default)]
    pub(super) plan: BTreeMap<String, BTreeMap<String, S<RawTierLimits>>>,
    #[serde(default)]
    pub(super) tenant: Vec<RawTenant>,
    #[serde(default)]
    pub(super) price: BTreeMap<String, S<RawPrice>>,
    #[serde(default)]
    pub(super) account: Vec<RawAccount>,
    #[serde(default)]
    pub(super) demo: RawDemo,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGateway {
    pub(super) listen: Option<S<String>>,
    pub(super) max_wait: Option<S<String>>,
    pub(super) max_request_tokens: Option<S<u64>>,
    pub(super) max_body_bytes: Option<S<u64>>,
    pub(super) fair_tier: Option<S<String>>,
    pub(super) tenant_queue: Option<S<u64>>,
    pub(super) queue: Option<S<u64>>,
    pub(super) selection: Option<S<String>>,
    /// Split into `embedding_models` and `chat_models`: named in the error.
    pub(super) models: Option<S<Vec<S<String>>>>,
    pub(super) embedding_models: Option<S<Vec<S<String>>>>,
    pub(super) chat_models: Option<S<Vec<S<String>>>>,
    pub(super) encodings: Option<S<BTreeMap<String, S<String>>>>,
    pub(super) default_max_tokens: Option<S<u64>>,
    pub(super) image_tokens: Option<S<u64>>,
    pub(super) header_timeout: Option<S<String>>,
    pub(super) idle_timeout: Option<S<String>>,
    pub(super) body_timeout: Option<S<String>>,
    pub(super) body_min_rate: Option<S<u64>>,
    pub(super) body_grace: Option<S<String>>,
    pub(super) uploads_per_tenant: Option<S<u64>>,
    pub(super) max_connections: Option<S<u64>>,
    pub(super) shutdown_grace: Option<S<String>>,
    pub(super) upstream_timeout: Option<S<String>>,
    pub(super) on_upstream_timeout: Option<S<String>>,
    pub(super) backend_failure: Option<S<String>>,
    pub(super) auth_failures_per_minute: Option<S<u64>>,
    pub(super) auth_failure_burst: Option<S<u64>>,
    pub(super) retry_spread_percent: Option<S<u64>>,
    pub(super) redis_timeout: Option<S<String>>,
    pub(super) account_lease_refresh: Option<S<String>>,
    pub(super) plan_share_refresh: Option<S<String>>,
    pub(super) bands: Option<S<Vec<RawBand>>>,
    pub(super) band_header: Option<S<String>>,
    pub(super) timezone: Option<S<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBand {
    pub(super) name: S<String>,
    pub(super) min_share_percent: Option<S<u64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMirror {
    pub(super) jitter: Option<S<String>>,
    pub(super) burst_percent: Option<S<u64>>,
    pub(super) learn_ceiling_percent: Option<S<u64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    pub(super) listen: Option<S<String>>,
    pub(super) dimensions: Option<S<u64>>,
    pub(super) latency: Option<S<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTierLimits {
    pub(super) budget: Option<S<String>>,
    pub(super) rpm: Option<S<u64>>,
    pub(super) tpm: Option<S<u64>>,
    pub(super) concurrency: Option<S<u64>>,
    pub(super) rpm_burst: Option<S<u64>>,
    pub(super) tpm_burst: Option<S<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPrice {
    pub(super) currency: S<String>,
    pub(super) input: S<f64>,
    pub(super) output: Option<S<f64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenant {
    pub(super) name: S<String>,
    pub(super) plan: S<String>,
    pub(super) weight: Option<S<u64>>,
    pub(super) band: Option<S<String>>,
    #[serde(default)]
    pub(super) key: Vec<BTreeMap<String, S<String>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAccount {
    pub(super) name: S<String>,
    pub(super) base_url: S<String>,
    pub(super) api_key: S<String>,
    pub(super) rpm: S<u64>,
    pub(super) tpm: S<u64>,
    pub(super) window: Option<S<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDemo {
    pub(super) seconds: Option<S<u64>>,
    pub(super) tolerance: Option<S<f64>>,
    #[serde(default)]
    pub(super) client: Vec<RawClient>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClient {
    pub(super) key: S<String>,
    pub(super) batch: S<u64>,
    pub(super) words: S<u64>,
    pub(super) concurrency: S<u64>,
}
