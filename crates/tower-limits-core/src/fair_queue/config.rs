//! What a [`FairQueue`](super::FairQueue) is configured with, and how it refuses.
//!
//! Weights and queue limits as plain data (serde), their validation, and [`QueueFull`],
//! the refusal of a request whose tenant's queue or the whole queue is full (429 or 503),
//! which gives the item back. A configuration that validates has every weight and both
//! queue limits at least 1, and neither limit above [`MAX_QUEUE_LIMIT`]: the queue
//! indexes its slabs with 32 bits.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::policy_error::PolicyError;

/// The default bound on one tenant's queued requests.
pub const DEFAULT_TENANT_QUEUE_LIMIT: usize = 64;

/// The default bound on all queued requests.
pub const DEFAULT_GLOBAL_QUEUE_LIMIT: usize = 1024;

/// The largest queue limit accepted (the queue indexes its slabs with 32 bits).
pub const MAX_QUEUE_LIMIT: usize = (1 << 31) - 1;

/// The most priority bands a queue may have.
pub const MAX_BANDS: usize = 64;

/// A priority band of a [`FairQueue`](super::FairQueue): its name, and the share of what
/// the queue dispatches that it keeps while it has requests waiting, whatever the bands
/// before it have queued.
///
/// ```
/// use tower_limits_core::fair_queue::BandConfig;
///
/// let batch = BandConfig::new("batch", 10);
/// assert_eq!((batch.name.as_str(), batch.min_share_percent), ("batch", 10));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandConfig {
    /// The band's name, unique in the queue.
    pub name: String,
    /// The percentage of the cost dispatched that the band keeps while it waits; 0 for
    /// none (the band then goes only when the bands before it have nothing queued).
    #[serde(default)]
    pub min_share_percent: u32,
}

impl BandConfig {
    /// A band named `name` keeping `min_share_percent` percent while it waits.
    #[must_use]
    pub fn new(name: impl Into<String>, min_share_percent: u32) -> Self {
        BandConfig { name: name.into(), min_share_percent }
    }
}

/// How a [`FairQueue`](super::FairQueue) shares: weights and queue limits, as plain data.
///
/// Weights are relative: a tenant of weight 3 gets three times the cost of a tenant of
/// weight 1 when both are waiting. The queue itself takes each request's weight from
/// the caller; [`FairQueueConfig::weight_for`] is how a layer finds a tenant's weight
/// from its name.
///
/// ```
/// use tower_limits_core::fair_queue::FairQueueConfig;
///
/// let config: FairQueueConfig = toml::from_str(r#"
///     default_weight = 1
///     tenant_queue_limit = 32
///     global_queue_limit = 512
///
///     [weights]
///     acme = 4
/// "#).unwrap();
/// config.validate().unwrap();
/// assert_eq!(config.weight_for("acme"), 4);
/// assert_eq!(config.weight_for("globex"), 1);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FairQueueConfig {
    /// The weight of a tenant not listed in `weights`; at least 1. Defaults to 1.
    #[serde(default = "default_weight")]
    pub default_weight: u32,
    /// Weights by tenant name, each at least 1.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: BTreeMap<String, u32>,
    /// The most requests one tenant can have queued; at least 1. Defaults to 64.
    #[serde(default = "default_tenant_queue_limit")]
    pub tenant_queue_limit: usize,
    /// The most requests queued in all; at least 1. Defaults to 1024.
    #[serde(default = "default_global_queue_limit")]
    pub global_queue_limit: usize,
    /// Priority bands, the first going first; none is one band. Their minimum shares sum
    /// to at most 100.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bands: Vec<BandConfig>,
    /// The band of requests queued without one; the first band when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_band: Option<String>,
}

fn default_weight() -> u32 {
    1
}

fn default_tenant_queue_limit() -> usize {
    DEFAULT_TENANT_QUEUE_LIMIT
}

fn default_global_queue_limit() -> usize {
    DEFAULT_GLOBAL_QUEUE_LIMIT
}

impl Default for FairQueueConfig {
    fn default() -> Self {
        FairQueueConfig {
            default_weight: 1,
            weights: BTreeMap::new(),
            tenant_queue_limit: DEFAULT_TENANT_QUEUE_LIMIT,
            global_queue_limit: DEFAULT_GLOBAL_QUEUE_LIMIT,
            bands: Vec::new(),
            default_band: None,
        }
    }
}

impl FairQueueConfig {
    /// Weight 1 for everyone and the default queue limits.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// With this weight for tenants not listed.
    #[must_use]
    pub fn default_weight(mut self, weight: u32) -> Self {
        self.default_weight = weight;
        self
    }

    /// With a weight for the tenant named `name`.
    #[must_use]
    pub fn weight(mut self, name: impl Into<String>, weight: u32) -> Self {
        self.weights.insert(name.into(), weight);
        self
    }

    /// With a bound on one tenant's queued requests.
    #[must_use]
    pub fn tenant_queue_limit(mut self, limit: usize) -> Self {
        self.tenant_queue_limit = limit;
        self
    }

    /// With a bound on all queued requests.
    #[must_use]
    pub fn global_queue_limit(mut self, limit: usize) -> Self {
        self.global_queue_limit = limit;
        self
    }

    /// With a priority band after those already given: `name`, keeping
    /// `min_share_percent` percent of what the queue dispatches while it has requests
    /// waiting. The first band goes first.
    ///
    /// ```
    /// use tower_limits_core::fair_queue::FairQueueConfig;
    ///
    /// let config = FairQueueConfig::new().band("interactive", 0).band("batch", 10).default_band("batch");
    /// config.validate().unwrap();
    /// assert_eq!(config.band_index("batch"), Some(1));
    /// ```
    #[must_use]
    pub fn band(mut self, name: impl Into<String>, min_share_percent: u32) -> Self {
        self.bands.push(BandConfig::new(name, min_share_percent));
        self
    }

    /// With the band of requests queued without one (the first band when unset).
    #[must_use]
    pub fn default_band(mut self, name: impl Into<String>) -> Self {
        self.default_band = Some(name.into());
        self
    }

    /// The index of the band named `name` (0 is the first).
    #[must_use]
    pub fn band_index(&self, name: &str) -> Option<usize> {
        self.bands.iter().position(|b| b.name == name)
    }

    /// The index of the band of requests queued without one.
    #[must_use]
    pub fn default_band_index(&self) -> usize {
        self.default_band.as_deref().and_then(|n| self.band_index(n)).unwrap_or(0)
    }

    /// The weight of the tenant named `name`: its entry in `weights`, or the default.
    #[must_use]
    pub fn weight_for(&self, name: &str) -> u32 {
        self.weights.get(name).copied().unwrap_or(self.default_weight)
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// The first problem found, naming its field (`weights["acme"]: must be at least 1`).
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.default_weight == 0 {
            return Err(PolicyError::new("default_weight", "must be at least 1"));
        }
        if let Some((name, _)) = self.weights.iter().find(|(_, w)| **w == 0) {
            return Err(PolicyError::new(format!("weights[{name:?}]"), "must be at least 1"));
        }
        for (field, limit) in
            [("tenant_queue_limit", self.tenant_queue_limit), ("global_queue_limit", self.global_queue_limit)]
        {
            if limit == 0 {
                return Err(PolicyError::new(field, "must be at least 1"));
            }
            if limit > MAX_QUEUE_LIMIT {
                return Err(PolicyError::new(field, format!("must be at most {MAX_QUEUE_LIMIT}")));
            }
        }
        if self.bands.len() > MAX_BANDS {
            return Err(PolicyError::new("bands", format!("at most {MAX_BANDS} bands, got {}", self.bands.len())));
        }
        let mut total = 0u64;
        for (i, band) in self.bands.iter().enumerate() {
            if band.name.is_empty() {
                return Err(PolicyError::new(format!("bands[{i}].name"), "must not be empty"));
            }
            if self.bands[..i].iter().any(|b| b.name == band.name) {
                return Err(PolicyError::new(format!("bands[{i}].name"), format!("{:?} is named twice", band.name)));
            }
            total += u64::from(band.min_share_percent);
            if total > 100 {
                return Err(PolicyError::new(
                    format!("bands[{i}].min_share_percent"),
                    format!("the minimum shares sum to {total}%, above 100%"),
                ));
            }
        }
        if let Some(name) = &self.default_band {
            if self.band_index(name).is_none() {
                return Err(PolicyError::new("default_band", format!("no band is named {name:?}")));
            }
        }
        Ok(())
    }
}

/// Which queue was full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QueueKind {
    /// The tenant's own queue: the tenant asks for too much (HTTP 429).
    Tenant,
    /// The whole queue: shared overload (HTTP 503).
    Global,
}

/// A request refused because a queue was full. Gives the item back.
pub struct QueueFull<T> {
    pub(super) kind: QueueKind,
    pub(super) limit: usize,
    pub(super) item: T,
}

impl<T> QueueFull<T> {
    /// Which queue was full.
    #[must_use]
    pub fn kind(&self) -> QueueKind {
        self.kind
    }

    /// Whether it was the tenant's own queue (rather than the whole queue).
    #[must_use]
    pub fn is_tenant(&self) -> bool {
        self.kind == QueueKind::Tenant
    }

    /// The limit of the full queue.
    #[must_use]
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The item that was not queued.
    #[must_use]
    pub fn into_item(self) -> T {
        self.item
    }
}

impl<T> fmt::Debug for QueueFull<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueueFull").field("kind", &self.kind).field("limit", &self.limit).finish_non_exhaustive()
    }
}

impl<T> fmt::Display for QueueFull<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            QueueKind::Tenant => write!(f, "tenant queue is full ({} queued)", self.limit),
            QueueKind::Global => write!(f, "queue is full ({} queued)", self.limit),
        }
    }
}

impl<T> std::error::Error for QueueFull<T> {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fair_queue::FairQueue;

    #[test]
    fn config_validates_and_round_trips() {
        let config = FairQueueConfig::new().weight("acme", 4).tenant_queue_limit(8);
        config.validate().unwrap();
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(serde_json::from_str::<FairQueueConfig>(&json).unwrap(), config);
        let toml_text = toml::to_string(&config).unwrap();
        assert_eq!(toml::from_str::<FairQueueConfig>(&toml_text).unwrap(), config);
        assert_eq!(serde_json::from_str::<FairQueueConfig>("{}").unwrap(), FairQueueConfig::default());
        let err = |c: FairQueueConfig| c.validate().unwrap_err().to_string();
        assert_eq!(err(FairQueueConfig::new().default_weight(0)), "default_weight: must be at least 1");
        assert_eq!(err(FairQueueConfig::new().weight("acme", 0)), "weights[\"acme\"]: must be at least 1");
        assert_eq!(err(FairQueueConfig::new().tenant_queue_limit(0)), "tenant_queue_limit: must be at least 1");
        assert_eq!(
            err(FairQueueConfig::new().global_queue_limit(MAX_QUEUE_LIMIT + 1)),
            "global_queue_limit: must be at most 2147483647"
        );
        assert!(FairQueue::<u8, ()>::new(FairQueueConfig::new().global_queue_limit(0)).is_err());
        assert!(serde_json::from_str::<FairQueueConfig>(r#"{"weight": 1}"#).is_err());
    }
}
