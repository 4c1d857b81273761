//! LimitPool: several limit sets (upstream accounts, regions, API keys), one chosen per
//! request.
//!
//! Each member is a [`LimitSet`] mirroring one upstream account's own limits (its
//! requests and tokens per minute), with a configuration of the caller's choosing (the
//! account's API key and base URL). An acquisition tries the members in the order of the
//! [`Selection`] policy and takes the first whose set grants the request; the
//! [`PoolGrant`] says which member that was, so the request can be sent with that
//! member's configuration. When every member refuses, the refusal is the one that frees
//! first.
//!
//! Members learn from what the upstream says ([`LimitPool::observe`]): an answer with
//! `Retry-After` (a 429) benches the member until then, and `x-ratelimit-remaining-*`
//! values lower than the local mirror's are charged to it, so that a local mirror which
//! drifted from the upstream (other clients on the same account, restarts) catches up
//! and the upstream never has to refuse again.
//!
//! With the `metrics` feature, every choice and every upstream answer is counted by
//! member name (see the `metrics` module).
//!
//! `LimitPool` implements [`Backend`], so every layer that takes a backend can spread its
//! requests over the pool.
//!
//! # Accounts shared by a fleet
//!
//! In memory, each process mirrors the accounts on its own: several replicas of one
//! gateway would each believe they own every account. A pool built with
//! [`LimitPoolBuilder::shared`] keeps its members' state in a [`SharedAccounts`] store
//! instead (the Redis one is `tower_limits_redis::RedisAccounts`): choosing the member
//! and charging it happen there in one step, upstream feedback is applied there once and
//! seen by every replica, and the members' local sets only serve while the store cannot
//! answer (as the store's failure policy says). The pool's API is the same; its
//! [`Backend::acquire`] then waits for the store, which it asks with the request's tenant
//! key ([`SharedAccounts::acquire_for`]): a store that shares the accounts fairly across a
//! fleet ([`crate::fleet`]) charges the tenant's turn too.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::backend::Backend;
use crate::error::AcquireError;
use crate::key::TenantKey;
use crate::limit::Counts;
use crate::policy_error::PolicyError;
use crate::set::{Grant, LimitSet, LimitSnapshot};
use crate::time::Instant;

/// How a pool orders its members for each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Selection {
    /// Each request starts at the next member in turn.
    #[default]
    RoundRobin,
    /// Each request starts at a member drawn at random.
    Random,
    /// The member with the most room left for this request's cost first (by the smallest
    /// remaining fraction over its rate limits).
    MostHeadroom,
}

/// What an upstream said about an account in its answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UpstreamReport {
    /// `Retry-After` (or an equivalent): the account refused, and will not serve again
    /// before this long.
    pub retry_after: Option<Duration>,
    /// `x-ratelimit-remaining-requests`.
    pub remaining_requests: Option<u64>,
    /// `x-ratelimit-remaining-tokens`.
    pub remaining_tokens: Option<u64>,
    /// `x-ratelimit-limit-requests`: the account's request quota as the upstream states
    /// it (for a [`QuotaLearner`](crate::learn::QuotaLearner)).
    pub limit_requests: Option<u64>,
    /// `x-ratelimit-limit-tokens`: its token quota as stated.
    pub limit_tokens: Option<u64>,
}

/// Which member served a request, and its configuration.
#[derive(Debug)]
pub struct Chosen<T> {
    /// The member's position in the pool.
    pub index: usize,
    /// The member's name.
    pub name: Arc<str>,
    /// The member's configuration (for example its API key and base URL).
    pub config: Arc<T>,
}

impl<T> Clone for Chosen<T> {
    fn clone(&self) -> Self {
        Chosen { index: self.index, name: self.name.clone(), config: self.config.clone() }
    }
}

/// A grant from one member of a pool.
#[derive(Debug)]
#[must_use = "a grant holds concurrency until it is released"]
pub struct PoolGrant<T> {
    chosen: Chosen<T>,
    grant: MemberGrant,
}

/// What a pool grant holds: a grant of the member's local set, or of the shared store.
#[derive(Debug)]
enum MemberGrant {
    Local(Grant),
    Shared(SharedGrant),
}

impl MemberGrant {
    fn holds_concurrency(&self) -> bool {
        match self {
            MemberGrant::Local(g) => g.holds_concurrency(),
            MemberGrant::Shared(_) => false,
        }
    }
}

/// A grant of a [`SharedAccounts`] store: plain data the store reads back when the grant
/// is settled or cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedGrant {
    /// The member charged, by its position in the pool.
    pub index: usize,
    /// The cost charged to the member's limits that count cost, now.
    pub charged: u64,
}

/// The future of a [`SharedAccounts`] acquisition.
pub type SharedAcquire = Pin<Box<dyn Future<Output = Result<SharedGrant, AcquireError>> + Send>>;

/// Where the state of a pool's members lives when a fleet shares it: the seam a shared
/// backend (Redis) implements for [`LimitPool`].
///
/// The members' limits are rate limits over the whole account (global, no semaphore),
/// so a grant holds nothing to release. An implementation must guarantee what
/// [`Backend`] does per member (all or nothing over the member's limits, one order per
/// member, one clock), and choose and charge in one atomic step, so that no two replicas
/// both see the same remaining capacity.
pub trait SharedAccounts: fmt::Debug + Send + Sync + 'static {
    /// Chooses the member with the most headroom for `cost` among those not benched, and
    /// charges it; or refuses with the wait after which one would grant.
    fn acquire(&self, cost: u64, now: Instant) -> SharedAcquire;

    /// As [`acquire`](Self::acquire), for a request of tenant `key` (the key the pool
    /// was asked with): a store that shares capacity fairly across a fleet
    /// ([`FleetShares`](crate::fleet::FleetShares)) needs to know whose request it
    /// charges. By default, the tenant is ignored.
    fn acquire_for(&self, key: &TenantKey, cost: u64, now: Instant) -> SharedAcquire {
        let _ = key;
        self.acquire(cost, now)
    }

    /// Corrects the cost charged to the grant's member from `grant.charged` to `actual`
    /// (in the background; the store updates `grant.charged`).
    fn settle(&self, grant: &mut SharedGrant, actual: u64, now: Instant);

    /// Refunds what the grant charged (its request and its cost), in the background.
    fn cancel(&self, grant: SharedGrant, now: Instant);

    /// Applies what the upstream said about the member at `index`, once, for every replica.
    fn observe(&self, index: usize, report: &UpstreamReport, now: Instant);

    /// Until when the member at `index` is benched, as far as this replica last heard.
    fn benched_until(&self, index: usize, now: Instant) -> Option<Instant>;

    /// Whether, when the store cannot answer, the pool decides in its members' local sets
    /// (sized by the caller to this replica's share of each account) instead of refusing.
    fn local_fallback(&self) -> bool {
        false
    }

    /// The member's limits as this replica last saw them (may be empty).
    fn peek(&self, index: usize, now: Instant) -> Vec<LimitSnapshot> {
        let _ = (index, now);
        Vec::new()
    }
}

impl<T> PoolGrant<T> {
    /// The member that granted the request.
    #[must_use]
    pub fn chosen(&self) -> &Chosen<T> {
        &self.chosen
    }
}

struct Member<T> {
    name: Arc<str>,
    set: LimitSet,
    config: Arc<T>,
    /// Nanoseconds of the pool's clock before which the member is not chosen.
    benched_until: AtomicU64,
}

struct Inner<T> {
    members: Vec<Member<T>>,
    shared: OnceLock<Arc<dyn SharedAccounts>>,
    selection: Selection,
    next: AtomicUsize,
    seed: AtomicU64,
}

/// Several limit sets, one chosen per request. Clones share the members and their state.
///
/// ```
/// use tower_limits_core::pool::{LimitPool, Selection};
/// use tower_limits_core::{Instant, LimitPolicy, LimitSet, LimitSetPolicy, Quota, TenantKey, nz};
///
/// let rpm = Quota::per_minute(nz!(60)).burst(nz!(1));
/// let account = || LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", rpm))).unwrap();
/// let pool = LimitPool::builder(Selection::RoundRobin)
///     .member("primary", account(), "sk-primary")
///     .member("secondary", account(), "sk-secondary")
///     .build()
///     .unwrap();
/// let key = TenantKey::global();
/// let a = pool.acquire(&key, 1, Instant::ZERO).unwrap();
/// let b = pool.acquire(&key, 1, Instant::ZERO).unwrap();
/// assert_ne!(a.chosen().name, b.chosen().name);
/// assert!(pool.acquire(&key, 1, Instant::ZERO).is_err(), "both accounts used their burst");
/// # pool.release(&key, a); pool.release(&key, b);
/// ```
pub struct LimitPool<T = ()> {
    inner: Arc<Inner<T>>,
}

impl<T> Clone for LimitPool<T> {
    fn clone(&self) -> Self {
        LimitPool { inner: self.inner.clone() }
    }
}

impl<T> fmt::Debug for LimitPool<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitPool")
            .field("members", &self.inner.members.iter().map(|m| &*m.name).collect::<Vec<_>>())
            .field("selection", &self.inner.selection)
            .finish()
    }
}

/// Builds a [`LimitPool`].
#[derive(Debug)]
#[must_use]
pub struct LimitPoolBuilder<T> {
    selection: Selection,
    members: Vec<(String, LimitSet, T)>,
    shared: Option<Arc<dyn SharedAccounts>>,
}

impl<T> LimitPoolBuilder<T> {
    /// One more member: an account named `name` whose limits `set` mirrors, with its
    /// configuration.
    pub fn member(mut self, name: impl Into<String>, set: LimitSet, config: T) -> Self {
        self.members.push((name.into(), set, config));
        self
    }

    /// Keeps the members' state in `store`, shared by every replica built on it: the
    /// store chooses (by most headroom, whatever the selection) and charges, and the
    /// members' local sets serve only as the store's failure policy says. The store's
    /// members must be these members, in this order.
    pub fn shared(mut self, store: Arc<dyn SharedAccounts>) -> Self {
        self.shared = Some(store);
        self
    }

    /// The pool.
    ///
    /// # Errors
    /// No member, or two members with one name.
    pub fn build(self) -> Result<LimitPool<T>, PolicyError> {
        if self.members.is_empty() {
            return Err(PolicyError::new("members", "a pool needs at least one member"));
        }
        for (i, (name, _, _)) in self.members.iter().enumerate() {
            if self.members[..i].iter().any(|(n, _, _)| n == name) {
                return Err(PolicyError::new(format!("members[{i}]"), format!("{name:?} is already a member's name")));
            }
        }
        let members = self
            .members
            .into_iter()
            .map(|(name, set, config)| Member {
                name: name.into(),
                set,
                config: Arc::new(config),
                benched_until: AtomicU64::new(0),
            })
            .collect();
        Ok(LimitPool {
            inner: Arc::new(Inner {
                members,
                shared: self.shared.map(OnceLock::from).unwrap_or_default(),
                selection: self.selection,
                next: AtomicUsize::new(0),
                seed: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
            }),
        })
    }
}

impl<T> LimitPool<T> {
    /// A builder for a pool choosing by `selection`.
    pub fn builder(selection: Selection) -> LimitPoolBuilder<T> {
        LimitPoolBuilder { selection, members: Vec::new(), shared: None }
    }

    /// How many members the pool has.
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.members.len()
    }

    /// Whether the pool has no member (never true for a built pool).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.inner.members.is_empty()
    }

    /// The limit set of the member at `index`.
    #[must_use]
    pub fn member_set(&self, index: usize) -> Option<&LimitSet> {
        self.inner.members.get(index).map(|m| &m.set)
    }

    /// The index of the member named `name`.
    #[must_use]
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.inner.members.iter().position(|m| &*m.name == name)
    }

    /// Until when the member at `index` is benched after an upstream refusal, if it is.
    #[must_use]
    pub fn benched_until(&self, index: usize, now: Instant) -> Option<Instant> {
        if let Some(store) = self.inner.shared.get() {
            return store.benched_until(index, now);
        }
        let until = self.inner.members.get(index)?.benched_until.load(Ordering::Acquire);
        (until > now.as_nanos()).then(|| Instant::from_nanos(until))
    }

    /// Moves the members' state to `store` from now on, as [`LimitPoolBuilder::shared`]
    /// would have (for a replica that starts before its shared store answers: until
    /// then its local sets decide). Answers false, changing nothing, when the pool is
    /// shared already. Grants made before keep settling in the local sets.
    pub fn share_through(&self, store: Arc<dyn SharedAccounts>) -> bool {
        self.inner.shared.set(store).is_ok()
    }

    /// Whether the members' state lives in a shared store ([`LimitPoolBuilder::shared`]).
    #[must_use]
    pub fn is_shared(&self) -> bool {
        self.inner.shared.get().is_some()
    }

    /// Acquires from the first member, in the selection's order, whose set grants the
    /// request; benched members are skipped. This decides in the local sets: a shared
    /// pool acquires through [`Backend::acquire`], which asks its store.
    ///
    /// # Errors
    /// When every member refuses: the refusal that frees first (a never-passing cost if
    /// it is above every member's capacity, a refusal naming the member's limit
    /// otherwise).
    pub fn acquire(&self, key: &TenantKey, cost: u64, now: Instant) -> Result<PoolGrant<T>, AcquireError> {
        let members = &self.inner.members;
        let n = members.len();
        let order = self.order(key, cost, now);
        let mut best: Option<AcquireError> = None;
        let mut earliest_bench: Option<u64> = None;
        for &i in order.iter().take(n) {
            let m = &members[i];
            let benched = m.benched_until.load(Ordering::Acquire);
            if benched > now.as_nanos() {
                earliest_bench = Some(earliest_bench.map_or(benched, |e| e.min(benched)));
                continue;
            }
            match m.set.acquire_grant(key, cost, now) {
                Ok(grant) => {
                    return Ok(PoolGrant { chosen: self.chosen(i), grant: MemberGrant::Local(grant) });
                }
                Err(e) => best = Some(sooner(best, e)),
            }
        }
        match best {
            Some(AcquireError::Refused(mut d)) => {
                if let Some(b) = earliest_bench {
                    let bench_wait = b - now.as_nanos();
                    if bench_wait < d.retry_nanos || d.needs_release {
                        d.retry_nanos = bench_wait;
                        d.needs_release = false;
                    }
                }
                Err(AcquireError::Refused(d))
            }
            Some(other) => Err(other),
            None => {
                // Every member is benched by its upstream.
                let wait = Duration::from_nanos(earliest_bench.unwrap_or(0).saturating_sub(now.as_nanos()));
                Err(AcquireError::Refused(crate::error::LimitRefusal::upstream(wait)))
            }
        }
    }

    fn chosen(&self, i: usize) -> Chosen<T> {
        let m = &self.inner.members[i];
        #[cfg(feature = "metrics")]
        crate::metrics::selected(&m.name);
        Chosen { index: i, name: m.name.clone(), config: m.config.clone() }
    }

    /// The members' indices in the order to try them for this request.
    fn order(&self, key: &TenantKey, cost: u64, now: Instant) -> Vec<usize> {
        let n = self.inner.members.len();
        let start = match self.inner.selection {
            Selection::RoundRobin => self.inner.next.fetch_add(1, Ordering::Relaxed) % n,
            Selection::Random => {
                // splitmix64 over a shared counter: cheap, lock-free, good enough to spread.
                let mut z = self.inner.seed.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                ((z ^ (z >> 31)) % n as u64) as usize
            }
            Selection::MostHeadroom => {
                let mut scored: Vec<(usize, (u64, u64))> = self
                    .inner
                    .members
                    .iter()
                    .enumerate()
                    .map(|(i, m)| (i, headroom(&m.set.peek(key, now), cost)))
                    .collect();
                // Most room first: compare a/b fractions by cross-multiplying.
                scored.sort_by(|(i, (a, b)), (j, (c, d))| {
                    (u128::from(*c) * u128::from(*b)).cmp(&(u128::from(*a) * u128::from(*d))).then(i.cmp(j))
                });
                return scored.into_iter().map(|(i, _)| i).collect();
            }
        };
        (0..n).map(|k| (start + k) % n).collect()
    }

    /// Learns from an upstream's answer for the member at `index`: benches it until its
    /// `retry_after`, and charges its local mirror down to the remaining counts it
    /// reported (never up).
    pub fn observe(&self, index: usize, report: &UpstreamReport, now: Instant) {
        let Some(m) = self.inner.members.get(index) else { return };
        #[cfg(feature = "metrics")]
        crate::metrics::upstream(&m.name, report.retry_after.is_some());
        if let Some(store) = self.inner.shared.get() {
            store.observe(index, report, now);
            return;
        }
        if let Some(wait) = report.retry_after {
            let until = (now + wait).as_nanos();
            m.benched_until.fetch_max(until, Ordering::AcqRel);
        }
        let key = TenantKey::global();
        if let Some(r) = report.remaining_requests {
            m.set.align_remaining(&key, Counts::Requests, r, now);
        }
        if let Some(r) = report.remaining_tokens {
            m.set.align_remaining(&key, Counts::Cost, r, now);
        }
    }

    /// Settles a grant to the real usage; see [`LimitSet::settle_grant`].
    pub fn settle(&self, key: &TenantKey, grant: &mut PoolGrant<T>, actual: u64, now: Instant) {
        match &mut grant.grant {
            MemberGrant::Local(g) => {
                if let Some(m) = self.inner.members.get(grant.chosen.index) {
                    m.set.settle_grant(key, g, actual, now);
                }
            }
            MemberGrant::Shared(g) => {
                if let Some(store) = self.inner.shared.get() {
                    store.settle(g, actual, now);
                }
            }
        }
    }

    /// Releases a grant; see [`LimitSet::release_grant`].
    pub fn release(&self, key: &TenantKey, grant: PoolGrant<T>) {
        if let (MemberGrant::Local(g), Some(m)) = (grant.grant, self.inner.members.get(grant.chosen.index)) {
            m.set.release_grant(key, g);
        }
    }

    /// Refunds and releases a grant; see [`LimitSet::cancel_grant`].
    pub fn cancel(&self, key: &TenantKey, grant: PoolGrant<T>, now: Instant) {
        match grant.grant {
            MemberGrant::Local(g) => {
                if let Some(m) = self.inner.members.get(grant.chosen.index) {
                    m.set.cancel_grant(key, g, now);
                }
            }
            MemberGrant::Shared(g) => {
                if let Some(store) = self.inner.shared.get() {
                    store.cancel(g, now);
                }
            }
        }
    }
}

/// The tightest remaining fraction over a member's rate limits after `cost`, as
/// (numerator, denominator).
fn headroom(limits: &[LimitSnapshot], cost: u64) -> (u64, u64) {
    limits
        .iter()
        .filter(|l| !l.is_semaphore)
        .map(|l| {
            let need = if l.counts == Counts::Cost { cost } else { 1 };
            (l.snapshot.remaining.saturating_sub(need), l.snapshot.quota.max(1))
        })
        .min_by(|(a, b), (c, d)| (u128::from(*a) * u128::from(*d)).cmp(&(u128::from(*c) * u128::from(*b))))
        .unwrap_or((1, 1))
}

/// Of two refusals, the one to report: a refusal that frees sooner beats a later one, and
/// any refusal beats a never-passing cost (another member may be larger).
fn sooner(best: Option<AcquireError>, next: AcquireError) -> AcquireError {
    match (best, next) {
        (None, next) => next,
        (Some(AcquireError::Refused(a)), AcquireError::Refused(b)) => {
            let key = |d: &crate::LimitRefusal| (d.needs_release, d.retry_nanos);
            AcquireError::Refused(if key(&b) < key(&a) { b } else { a })
        }
        (Some(AcquireError::Refused(a)), _) => AcquireError::Refused(a),
        (Some(_), AcquireError::Refused(b)) => AcquireError::Refused(b),
        (Some(a), _) => a,
    }
}

impl<T: Send + Sync + 'static> Backend for LimitPool<T> {
    type Grant = PoolGrant<T>;
    type Acquire = PoolAcquire<T>;

    fn acquire(&self, key: &TenantKey, cost: u64, now: Instant) -> Self::Acquire {
        match self.inner.shared.get() {
            None => PoolAcquire { state: AcquireState::Ready(Some(LimitPool::acquire(self, key, cost, now))) },
            Some(store) => PoolAcquire {
                state: AcquireState::Shared {
                    fut: store.acquire_for(key, cost, now),
                    pool: self.clone(),
                    key: key.clone(),
                    cost,
                    now,
                },
            },
        }
    }

    fn acquire_now(&self, key: &TenantKey, cost: u64, now: Instant) -> Option<Result<PoolGrant<T>, AcquireError>> {
        // Accounts shared by a fleet are asked over the network; local ones answer now.
        match self.inner.shared.get() {
            None => Some(LimitPool::acquire(self, key, cost, now)),
            Some(_) => None,
        }
    }

    fn settle(&self, key: &TenantKey, grant: &mut PoolGrant<T>, actual: u64, now: Instant) {
        LimitPool::settle(self, key, grant, actual, now);
    }

    fn release(&self, key: &TenantKey, grant: PoolGrant<T>) {
        LimitPool::release(self, key, grant);
    }

    fn cancel(&self, key: &TenantKey, grant: PoolGrant<T>, now: Instant) {
        LimitPool::cancel(self, key, grant, now);
    }

    fn needs_release(&self, grant: &PoolGrant<T>) -> bool {
        grant.grant.holds_concurrency()
    }

    fn shadow_refusal(&self, grant: &PoolGrant<T>) -> Option<(&'static str, Option<&'static str>)> {
        match &grant.grant {
            MemberGrant::Local(g) if g.shadowed != 0 => g.shadow_refusals().next(),
            _ => None,
        }
    }

    fn observe_upstream(&self, grant: &PoolGrant<T>, report: &UpstreamReport, now: Instant) {
        self.observe(grant.chosen().index, report, now);
    }

    fn peek(&self, key: &TenantKey, now: Instant) -> Vec<LimitSnapshot> {
        // The best member's view: what the next request would most likely get.
        if let Some(store) = self.inner.shared.get() {
            return (0..self.len()).map(|i| store.peek(i, now)).max_by_key(|v| v.len()).unwrap_or_default();
        }
        let order = self.order(key, 1, now);
        order.first().and_then(|&i| self.inner.members.get(i)).map(|m| m.set.peek(key, now)).unwrap_or_default()
    }
}

/// The acquisition future of a [`LimitPool`]: ready at once in memory; for a shared pool,
/// the store's answer.
///
/// # Cancel safety
/// Dropping it while the store works leaves the store's future to its own cancel safety
/// (the Redis store cancels a grant that arrives after its future was dropped).
pub struct PoolAcquire<T> {
    state: AcquireState<T>,
}

enum AcquireState<T> {
    Ready(Option<Result<PoolGrant<T>, AcquireError>>),
    Shared { fut: SharedAcquire, pool: LimitPool<T>, key: TenantKey, cost: u64, now: Instant },
}

impl<T> fmt::Debug for PoolAcquire<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            AcquireState::Ready(_) => "ready",
            AcquireState::Shared { .. } => "waiting for the shared store",
        };
        f.debug_struct("PoolAcquire").field("state", &state).finish()
    }
}

impl<T> Future for PoolAcquire<T> {
    type Output = Result<PoolGrant<T>, AcquireError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &mut this.state {
            AcquireState::Ready(result) => Poll::Ready(result.take().unwrap_or_else(|| {
                Err(AcquireError::Unavailable(crate::error::Unavailable::new("acquisition polled after it completed")))
            })),
            AcquireState::Shared { fut, pool, key, cost, now } => {
                let result = std::task::ready!(fut.as_mut().poll(cx));
                let fallback = pool.inner.shared.get().is_some_and(|s| s.local_fallback());
                Poll::Ready(match result {
                    Ok(g) if g.index < pool.len() => {
                        Ok(PoolGrant { chosen: pool.chosen(g.index), grant: MemberGrant::Shared(g) })
                    }
                    Ok(_) => Err(AcquireError::Unavailable(crate::error::Unavailable::new(
                        "the shared store chose a member the pool does not have",
                    ))),
                    // The store is away: this replica's share of each account, decided here.
                    Err(AcquireError::Unavailable(_)) if fallback => pool.acquire(key, *cost, *now),
                    Err(e) => Err(e),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LimitPolicy, LimitSetPolicy, Quota};

    fn account(rpm: u64, tpm: u64) -> LimitSet {
        let per_minute = |n| Quota::try_new(n, Duration::from_secs(60)).unwrap();
        LimitSet::new(
            LimitSetPolicy::new()
                .limit(LimitPolicy::gcra("rpm", per_minute(rpm)))
                .limit(LimitPolicy::token_bucket("tpm", per_minute(tpm)).counting_cost()),
        )
        .unwrap()
    }

    #[test]
    fn most_headroom_prefers_the_emptier_account() {
        let pool = LimitPool::builder(Selection::MostHeadroom)
            .member("small", account(60, 1_000), ())
            .member("large", account(60, 100_000), ())
            .build()
            .unwrap();
        let key = TenantKey::global();
        let g = pool.acquire(&key, 500, Instant::ZERO).unwrap();
        assert_eq!(&*g.chosen().name, "large");
        pool.release(&key, g);
    }

    #[test]
    fn a_refusing_upstream_benches_its_member() {
        let pool = LimitPool::builder(Selection::RoundRobin)
            .member("a", account(60, 1_000), 1)
            .member("b", account(60, 1_000), 2)
            .build()
            .unwrap();
        let key = TenantKey::global();
        pool.observe(
            0,
            &UpstreamReport { retry_after: Some(Duration::from_secs(5)), ..Default::default() },
            Instant::ZERO,
        );
        for _ in 0..4 {
            let g = pool.acquire(&key, 1, Instant::ZERO).unwrap();
            assert_eq!(g.chosen().index, 1, "a is benched");
            pool.release(&key, g);
        }
        let later = Instant::from_nanos(5_000_000_000);
        assert_eq!(pool.benched_until(0, later), None);
        let picks: Vec<usize> = (0..2)
            .map(|_| {
                let g = pool.acquire(&key, 1, later).unwrap();
                let i = g.chosen().index;
                pool.release(&key, g);
                i
            })
            .collect();
        assert!(picks.contains(&0), "a serves again after its retry time");
    }

    #[test]
    fn reported_remaining_corrects_the_mirror() {
        let pool = LimitPool::builder(Selection::RoundRobin).member("a", account(60, 1_000), ()).build().unwrap();
        let key = TenantKey::global();
        pool.observe(
            0,
            &UpstreamReport { remaining_tokens: Some(100), remaining_requests: Some(70), ..Default::default() },
            Instant::ZERO,
        );
        let snapshots = pool.member_set(0).unwrap().peek(&key, Instant::ZERO);
        assert_eq!(snapshots[1].snapshot.remaining, 100);
        assert_eq!(snapshots[0].snapshot.remaining, 60, "never raised above the local view");
        assert!(pool.acquire(&key, 101, Instant::ZERO).is_err());
    }

    #[test]
    fn when_all_refuse_the_earliest_wins() {
        let pool = LimitPool::builder(Selection::RoundRobin)
            .member("a", account(1, 1_000), ())
            .member("b", account(2, 1_000), ())
            .build()
            .unwrap();
        let key = TenantKey::global();
        let grants: Vec<_> = (0..3).map(|_| pool.acquire(&key, 1, Instant::ZERO).unwrap()).collect();
        match pool.acquire(&key, 1, Instant::ZERO) {
            Err(AcquireError::Refused(d)) => assert_eq!(d.retry_after(), Duration::from_secs(30), "b frees first"),
            other => panic!("{other:?}"),
        }
        for g in grants {
            pool.release(&key, g);
        }
    }
}
