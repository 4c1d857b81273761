//! Fleet-wide weighted fairness: what a replica's fair queue and a shared store tell each
//! other.
//!
//! A fair queue shares capacity by weight among the requests *it* sees. In a fleet whose
//! balancer routes unevenly, each replica sees a different mix of tenants, so per-replica
//! fairness gives shares that follow the routing. [`FleetShares`] is the small handle
//! through which a replica's fair queue and a shared store (the Redis upstream accounts,
//! `tower_limits_redis::RedisAccounts`) make the shares hold for the fleet:
//!
//! 1. the fair queue [publishes](FleetShares::publish) its backlog (per tenant and band:
//!    the tenant's weight and the requests it has waiting) and the band of the request
//!    it is about to acquire before every acquisition, and counts the requests it
//!    admitted until they end ([`admitted`](FleetShares::admitted),
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
//! **Priority bands.** A fair queue with bands tells the handle their minimum shares
//! ([`set_bands`](FleetShares::set_bands)) and, with each backlog, the band of the
//! request it acquires. The store then orders the bands for the fleet as the queue does
//! for itself: the first band with work goes first, unless a later band with work
//! fleet-wide is owed its minimum share of what the fleet dispatched; inside a band,
//! replicas are weighed by their tenants waiting in that band only. The store also names
//! the band each replica dispatches from next ([`next_band`](FleetShares::next_band)), so
//! that no replica holds a request of a band whose turn has not come.
//!
//! ```
//! use tower_limits_core::TenantKey;
//! use tower_limits_core::fleet::{FULL_SHARE, FleetShares, Waiting};
//!
//! let fleet = FleetShares::new();
//! let acme = TenantKey::single("acme").unwrap();
//! // Before the store answers: the configured weight, in share units.
//! assert_eq!(fleet.local_weight(&acme, 3), 3 * FULL_SHARE);
//! fleet.publish([Waiting::new(acme.clone(), 3, 4)], 0);
//! fleet.admitted(&acme, 3);
//! let demand = fleet.demand();
//! assert_eq!((demand[0].waiting, demand[0].outstanding, demand[0].bands), (4, 5, 0b1));
//! fleet.finished(&acme);
//! // The store says this replica holds a quarter of acme's demand.
//! fleet.set_shares([(acme.clone(), FULL_SHARE / 4)]);
//! assert_eq!(fleet.local_weight(&acme, 3), 3 * FULL_SHARE / 4);
//! fleet.clear_shares();
//! assert_eq!(fleet.share(&acme), FULL_SHARE);
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

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
    /// The bands it has requests waiting in: bit `b` for band `b` (none when it only has
    /// requests in flight).
    pub bands: u64,
}

/// Requests of one tenant waiting in one band of a replica's fair queue, as the queue
/// [publishes](FleetShares::publish) them.
///
/// ```
/// use tower_limits_core::TenantKey;
/// use tower_limits_core::fleet::Waiting;
///
/// let batch = Waiting::new(TenantKey::single("initech").unwrap(), 1, 5).in_band(1);
/// assert_eq!((batch.weight, batch.requests, batch.band), (1, 5, 1));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    /// The tenant.
    pub key: TenantKey,
    /// Its configured weight.
    pub weight: u32,
    /// Its requests waiting in the band.
    pub requests: u64,
    /// The band (0, the first, unless [`in_band`](Self::in_band) says otherwise).
    pub band: usize,
}

impl Waiting {
    /// `requests` of `key` (configured `weight`) waiting in the first band.
    #[must_use]
    pub fn new(key: TenantKey, weight: u32, requests: u64) -> Self {
        Waiting { key, weight, requests, band: 0 }
    }

    /// The same requests, waiting in `band`.
    #[must_use]
    pub fn in_band(mut self, band: usize) -> Self {
        self.band = band;
        self
    }
}

#[derive(Default)]
struct State {
    /// Per backlogged tenant: its configured weight, its waiting requests and the bands
    /// they wait in (a bit each).
    backlog: Vec<(TenantKey, u32, u64, u64)>,
    /// The band of the request being acquired.
    band: usize,
    /// The fair queue's bands' minimum shares, in percent (empty: one band).
    min_shares: Vec<u32>,
    /// The band the store asks this replica to dispatch from next.
    next_band: Option<usize>,
    /// The bands' minimum shares of this replica's dispatches the store asks for, in
    /// millionths (`None`: the queue's own).
    band_shares: Option<Arc<[u32]>>,
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
            .field("band", &state.band)
            .field("min_shares", &state.min_shares)
            .field("next_band", &state.next_band)
            .field("band_shares", &state.band_shares)
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

    /// The fair queue's side: its backlog now, per tenant and band, and the band of the
    /// request it is about to acquire, replacing the last ones. A tenant waiting in
    /// several bands may be listed once per band.
    pub fn publish(&self, backlog: impl IntoIterator<Item = Waiting>, band: usize) {
        let backlog = backlog.into_iter();
        let mut merged: Vec<(TenantKey, u32, u64, u64)> = Vec::with_capacity(backlog.size_hint().0);
        let mut at: HashMap<TenantKey, usize> = HashMap::with_capacity(backlog.size_hint().0);
        for w in backlog {
            let bit = band_bit(w.band);
            match at.get(&w.key) {
                Some(&i) => {
                    merged[i].2 += w.requests;
                    merged[i].3 |= bit;
                }
                None => {
                    at.insert(w.key.clone(), merged.len());
                    merged.push((w.key, w.weight, w.requests, bit));
                }
            }
        }
        let mut state = self.lock();
        state.backlog = merged;
        state.band = band;
    }

    /// The fair queue's side, once: its bands' minimum shares in percent, in band order
    /// (a queue with one band need not say).
    pub fn set_bands(&self, min_shares: impl IntoIterator<Item = u32>) {
        self.lock().min_shares = min_shares.into_iter().collect();
    }

    /// The store's side: the bands' minimum shares in percent (empty: one band).
    ///
    /// ```
    /// use tower_limits_core::fleet::FleetShares;
    ///
    /// let fleet = FleetShares::new();
    /// assert!(fleet.min_shares().is_empty());
    /// fleet.set_bands([0, 10]);
    /// assert_eq!(fleet.min_shares(), [0, 10]);
    /// ```
    #[must_use]
    pub fn min_shares(&self) -> Vec<u32> {
        self.lock().min_shares.clone()
    }

    /// The store's side: the band of the request being acquired, as last published.
    ///
    /// ```
    /// use tower_limits_core::TenantKey;
    /// use tower_limits_core::fleet::{FleetShares, Waiting};
    ///
    /// let fleet = FleetShares::new();
    /// let batch = TenantKey::single("initech").unwrap();
    /// fleet.publish([Waiting::new(batch, 1, 2).in_band(1)], 1);
    /// assert_eq!(fleet.band(), 1);
    /// assert_eq!(fleet.demand()[0].bands, 0b10);
    /// ```
    #[must_use]
    pub fn band(&self) -> usize {
        self.lock().band
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
            .map(|(key, weight, waiting, bands)| TenantDemand {
                key: key.clone(),
                weight: *weight,
                waiting: *waiting,
                outstanding: waiting + state.in_flight.get(key).map_or(0, |e| e.1),
                bands: *bands,
            })
            .collect();
        for (key, (weight, n)) in &state.in_flight {
            if !state.backlog.iter().any(|(k, ..)| k == key) {
                out.push(TenantDemand { key: key.clone(), weight: *weight, waiting: 0, outstanding: *n, bands: 0 });
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

    /// Every share whole again and no band asked for: per-replica fairness (the store
    /// cannot answer).
    pub fn clear_shares(&self) {
        let mut state = self.lock();
        state.shares.clear();
        state.next_band = None;
        state.band_shares = None;
    }

    /// The store's side: the minimum share of this replica's dispatches each band keeps
    /// while it waits, in millionths (`None`: the fair queue's own). A store that gives
    /// each replica a part of the capacity for each band (account leases) names here what
    /// the replica's part for each band is of all it holds, so that a later band whose
    /// requests land beside the first band's gets the share the fleet gave it there, not
    /// its configured share of everything the replica holds.
    pub fn set_band_shares(&self, shares: Option<Vec<u32>>) {
        self.lock().band_shares = shares.map(Arc::from);
    }

    /// The fair queue's side: the bands' minimum shares the store named, in millionths
    /// ([`FairQueue::set_min_shares`](crate::fair_queue::FairQueue::set_min_shares));
    /// shared, so that reading them before every dispatch copies nothing.
    ///
    /// ```
    /// use tower_limits_core::fleet::FleetShares;
    ///
    /// let fleet = FleetShares::new();
    /// assert_eq!(fleet.band_shares(), None);
    /// fleet.set_band_shares(Some(vec![0, 250_000]));
    /// assert_eq!(fleet.band_shares().as_deref(), Some(&[0, 250_000][..]));
    /// fleet.clear_shares();
    /// assert_eq!(fleet.band_shares(), None);
    /// ```
    #[must_use]
    pub fn band_shares(&self) -> Option<Arc<[u32]>> {
        self.lock().band_shares.clone()
    }

    /// The store's side: the band this replica should dispatch from next (`None`: its
    /// queue's own order). A fleet orders its bands as one queue would: a band owed its
    /// minimum share is dispatched by one replica at a time, the one the store chose,
    /// and every other replica dispatches from the first band with work, never holding a
    /// request of a band whose turn has not come.
    pub fn set_next_band(&self, band: Option<usize>) {
        self.lock().next_band = band;
    }

    /// The fair queue's side: the band to dispatch from next, if the store named one
    /// (the queue's own order when that band has nothing queued).
    ///
    /// ```
    /// use tower_limits_core::fleet::FleetShares;
    ///
    /// let fleet = FleetShares::new();
    /// assert_eq!(fleet.next_band(), None);
    /// fleet.set_next_band(Some(1));
    /// assert_eq!(fleet.next_band(), Some(1));
    /// fleet.clear_shares();
    /// assert_eq!(fleet.next_band(), None);
    /// ```
    #[must_use]
    pub fn next_band(&self) -> Option<usize> {
        self.lock().next_band
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

/// Band `band`'s bit in [`TenantDemand::bands`] (bands past the 64th share the last bit;
/// a fair queue has at most 64).
fn band_bit(band: usize) -> u64 {
    1 << band.min(63)
}
