//! Why a backend could not be built.

use std::fmt;

use tower_limits_core::PolicyError;

/// Why [`RedisBackendBuilder::build`](crate::RedisBackendBuilder::build) refused.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum BuildError {
    /// The policy itself is invalid (the same error the in-memory set gives).
    Policy(PolicyError),
    /// A limit is valid but cannot be evaluated exactly on Redis.
    Unsupported {
        /// The limit's name.
        limit: String,
        /// Why, and what to do instead.
        reason: String,
    },
    /// On a Redis Cluster, a global limit and a keyed limit of one set would live in
    /// different slots, so no single script could take both atomically.
    CrossSlot {
        /// A global limit of the set.
        global: String,
        /// A limit keyed by a tier.
        keyed: String,
    },
    /// Something else about the configuration.
    Invalid {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::Policy(e) => write!(f, "invalid policy: {e}"),
            BuildError::Unsupported { limit, reason } => write!(f, "limit {limit:?} cannot run on redis: {reason}"),
            BuildError::CrossSlot { global, keyed } => write!(
                f,
                "on a redis cluster, the global limit {global:?} and the keyed limit {keyed:?} would live in \
                 different slots, so one script cannot take both atomically: use SlotLayout::OneSlot (every key \
                 of the set in one slot), or put the global limits in a layer of their own"
            ),
            BuildError::Invalid { field, message } => write!(f, "{field}: {message}"),
        }
    }
}

impl std::error::Error for BuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BuildError::Policy(e) => Some(e),
            _ => None,
        }
    }
}

impl From<PolicyError> for BuildError {
    fn from(e: PolicyError) -> Self {
        BuildError::Policy(e)
    }
}
