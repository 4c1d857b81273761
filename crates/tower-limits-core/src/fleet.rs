//! Fleet-wide weighted fairness: what a replica's fair queue and a shared store tell each
//! other.
//!
//! A fair queue shares capacity by weight among the requests *it* sees. In a fleet whose
//! balancer routes unevenly, each replica sees a different mix of tenants, so per-replica
//! fairness gives shares that follow the routing. [`FleetShares`] is the small handle
//! through which a replica's fair queue and a shared store (the Redis upstream accounts,
//! `tower_limits_redis::RedisAccounts`) make the shares hold for the fleet:
//!
//! 1. the fair queue [publishes](FleetShares::publish) its backlog (per tenant: its
//!    weight and the requests it has waiting) before every acquisition, and counts the
//!    requests it admitted until they end ([`admitted`](FleetShares::admitted),
//!    [`finished`](FleetShares::finished));
//! 2. the store sends that [demand](FleetShares::demand) with the acquisition; the store,
//!    which sees every replica's demand, answers with this replica's
//!    [share](FleetShares::share) of each tenant's fleet demand (`d_r,t / Σ_r d_r,t`, `d`
//!    counting the tenant's requests waiting or in flight: a steady measure of how many
//!    of its clients this replica serves) and weighs the replica, among the replicas
//!    competing for capacity, by `Σ_t w_t · share_t` over the tenants it has waiting;
//! 3. the fair queue orders its tenants by [`local_weight`](FleetShares::local_weight):
//!    `w_t · share_t`.
//!
//! A replica then receives capacity in proportion to `Σ_t w_t · share_t`, and divides it
//! among its tenants in proportion to `w_t · share_t`: tenant `t` receives, summed over
//! the replicas, capacity in proportion to `w_t · Σ_r share_r,t = w_t`, whichever replica
//! its requests land on. The design and its bounds are in the Redis guide.
//!
//! Without a handle (or before the store first answers, or while it cannot) every share
//! is whole and a fair queue weighs its tenants exactly as configured: per-replica
//! fairness.
//!
//! ```
//! use tower_limits_core::TenantKey;
//! use tower_limits_core::fleet::{FULL_SHARE, FleetShares};
//!
//! let fleet = FleetShares::new();
//! let acme = TenantKey::single("acme").unwrap();
//! // Before the store answers: the configured weight, in share units.
//! assert_eq!(fleet.local_weight(&acme, 3), 3 * FULL_SHARE);
//! fleet.publish(vec![(acme.clone(), 3, 4)]);
//! fleet.admitted(&acme, 3);
//! let demand = fleet.demand();
//! assert_eq!((demand[0].waiting, demand[0].outstanding), (4, 5));
//! fleet.finished(&acme);
//! // The store says this replica holds a quarter of acme's demand.
//! fleet.set_shares([(acme.clone(), FULL_SHARE / 4)]);
//! assert_eq!(fleet.local_weight(&acme, 3), 3 * FULL_SHARE / 4);
//! fleet.clear_shares();
//! assert_eq!(fleet.share(&acme), FULL_SHARE);
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::key::TenantKey;

/// A whole share: a tenant whose fleet demand is all on this replica (or unknown).
pub const FULL_SHARE: u32 = 1024;

/// What one replica's fair queue and the fleet's shared store tell each other; see the
/// [module docs](self). Share it (`Arc`) between the fair queue and the store.
#[derive(Default)]
pub struct FleetShares {
    state: Mutex<State>,
}

/// One tenant's demand on this replica, as the store reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantDemand {
    /// The tenant.
    pub key: TenantKey,
    /// Its configured weight.
    pub weight: u32,
    /// Requests waiting for capacity (queued, or at the gate).
    pub waiting: u64,
    /// Requests waiting or admitted and not yet finished.
    pub outstanding: u64,
}

#[derive(Default)]
struct State {
    /// Per backlogged tenant: its configured weight and its waiting requests.
    backlog: Vec<(TenantKey, u32, u64)>,
    /// Per tenant: its configured weight and its requests admitted and not finished.
    in_flight: HashMap<TenantKey, (u32, u64)>,
    /// This replica's share of each tenant's fleet demand, in 1/[`FULL_SHARE`]s.
    shares: HashMap<TenantKey, u32>,
}

impl fmt::Debug for FleetShares {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("FleetShares")
            .field("backlog", &state.backlog)
            .field("in_flight", &state.in_flight)
            .field("shares", &state.shares)
            .finish()
    }
}

impl FleetShares {
    /// A handle with no backlog and every share whole.
    #[must_use]
    pub fn new() -> Self {
        FleetShares::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The fair queue's side: its backlog now, per tenant (configured weight, waiting
    /// requests), replacing the last one.
    pub fn publish(&self, backlog: Vec<(TenantKey, u32, u64)>) {
        self.lock().backlog = backlog;
    }

    /// The fair queue's side: a request of `key` (configured `weight`) was admitted.
    pub fn admitted(&self, key: &TenantKey, weight: u32) {
        let mut state = self.lock();
        let entry = state.in_flight.entry(key.clone()).or_insert((weight, 0));
        *entry = (weight, entry.1 + 1);
    }

    /// The fair queue's side: an admitted request of `key` ended.
    pub fn finished(&self, key: &TenantKey) {
        let mut state = self.lock();
        if let Some(entry) = state.in_flight.get_mut(key) {
            entry.1 = entry.1.saturating_sub(1);
            if entry.1 == 0 {
                state.in_flight.remove(key);
            }
        }
    }

    /// The store's side: per tenant with requests waiting or in flight, the last
    /// published backlog and the requests in flight.
    #[must_use]
    pub fn demand(&self) -> Vec<TenantDemand> {
        let state = self.lock();
        let mut out: Vec<TenantDemand> = state
            .backlog
            .iter()
            .map(|(key, weight, waiting)| TenantDemand {
                key: key.clone(),
                weight: *weight,
                waiting: *waiting,
                outstanding: waiting + state.in_flight.get(key).map_or(0, |e| e.1),
            })
            .collect();
        for (key, (weight, n)) in &state.in_flight {
            if !state.backlog.iter().any(|(k, _, _)| k == key) {
                out.push(TenantDemand { key: key.clone(), weight: *weight, waiting: 0, outstanding: *n });
            }
        }
        out
    }

    /// The store's side: this replica's share of each tenant's fleet demand, in
    /// 1/[`FULL_SHARE`]s (clamped to `1..=FULL_SHARE`), replacing the last answer; a
    /// tenant not named has a whole share.
    pub fn set_shares(&self, shares: impl IntoIterator<Item = (TenantKey, u32)>) {
        self.lock().shares = shares.into_iter().map(|(k, s)| (k, s.clamp(1, FULL_SHARE))).collect();
    }

    /// Every share whole again: per-replica fairness (the store cannot answer).
    pub fn clear_shares(&self) {
        self.lock().shares.clear();
    }

    /// This replica's share of `key`'s fleet demand, in 1/[`FULL_SHARE`]s.
    #[must_use]
    pub fn share(&self, key: &TenantKey) -> u32 {
        self.lock().shares.get(key).copied().unwrap_or(FULL_SHARE)
    }

    /// The weight the fair queue gives `key` here: its configured `weight` times its
    /// share (so in units of 1/[`FULL_SHARE`] of a weight).
    #[must_use]
    pub fn local_weight(&self, key: &TenantKey, weight: u32) -> u32 {
        weight.max(1).saturating_mul(self.share(key))
    }
}
