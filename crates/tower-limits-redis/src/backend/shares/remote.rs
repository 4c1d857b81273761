//! What capacity shares ask of Redis outside their group's refreshes (see
//! [`super::group`]): a semaphore's fetches, the pools' part of an acquisition (a thin
//! rate's bookings among it) and the settles sent in the background.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::Value;
use tower_limits_core::{AcquireError, Counts, Instant, LimitRefusal, Snapshot, TenantKey};

use super::table::{Local, Part, SharedGrant, Table};
use super::{ShareLimit, group};
use crate::backend::background::PendingGuard;
use crate::backend::call::{CallError, int_array};
use crate::backend::grant::{GrantKind, RedisGrant};
use crate::backend::{Inner, RedisAcquire, RedisBackend};
use crate::cache::CachedRefusal;
use crate::failure::Gate;
use crate::stats::bump;

impl Inner {
    pub(super) async fn eval_shares(
        &self,
        table: &Table,
        keys: &[Arc<str>],
        args: &[String],
    ) -> Result<Value, CallError> {
        let keys: Vec<&str> = keys.iter().map(|k| &**k).collect();
        self.call_script(&table.sha, &table.source, &keys, args).await
    }

    /// Fetches the shares of the scopes `only` (a semaphore's, for a request its share
    /// is too small for), one call per slot, outside the refresh group's periodic calls.
    /// Answers whether every call succeeded.
    pub(super) async fn fetch_shares(self: &Arc<Self>, table: &Table, now: Instant, only: &[Arc<str>]) -> bool {
        table.latest.fetch_max(now.as_nanos(), Ordering::Relaxed);
        let mut all = true;
        for (_, keys, args) in table.report(self, now, Some(only)) {
            let part = group::Part { member: self.clone(), keys, args, at: now };
            all &= group::send(self, table, Some(now), &[part], true).await;
        }
        all
    }

    /// Settles a grant from shares: the local parts at once, the pooled ones in the
    /// background.
    pub(in crate::backend) fn settle_shared(
        self: &Arc<Self>,
        grant: &SharedGrant,
        now: Instant,
        units: impl Fn(&Part) -> i128,
    ) {
        let Some(table) = &self.shares else { return };
        let gone = table.adjust(self, &grant.local, now, &units);
        let mut keys = Vec::new();
        let mut args = table.args_head(self, "S", now, table.permit_lease);
        for part in grant.pooled.iter().chain(&gone) {
            let n = units(part);
            let Some(l) = self.limits[part.limit].share else { continue };
            if n != 0 {
                keys.push(part.scope.clone());
                args.extend(pool_args(&l, part));
                args.push(n.to_string());
            }
        }
        if keys.is_empty() {
            return;
        }
        let Some(handle) = self.handle() else {
            bump(&self.stats.background_failures);
            return;
        };
        // Not resent after a failure: it may have been applied.
        let guard = PendingGuard::new(self);
        let inner = self.clone();
        let table = table.clone();
        handle.spawn(async move {
            if inner.eval_shares(&table, &keys, &args).await.is_ok() {
                bump(&inner.stats.background_ops);
            } else {
                bump(&inner.stats.background_failures);
            }
            drop(guard);
        });
    }
}

impl RedisBackend {
    /// Refreshes this replica's capacity shares now: reports its demand and renews every
    /// share it holds or wants, with those of the other backends of its
    /// [`ShareGroup`](crate::ShareGroup), one call per slot. The backends of a group do
    /// this every refresh period by themselves; call it by hand with a manual clock
    /// (tests), where it is the only refresh. Answers whether every call succeeded (false
    /// also when the backend has no shares).
    ///
    /// ```no_run
    /// use tower_limits_core::{Clock, LimitPolicy, LimitSetPolicy, Quota, SystemClock, nz};
    /// use tower_limits_redis::{RedisBackend, RedisConnection, Shares};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let policy = LimitSetPolicy::new()
    ///     .tiers(["tenant"])
    ///     .limit(LimitPolicy::gcra("per-tenant", Quota::per_second(nz!(100))).per("tenant"));
    /// let redis = RedisConnection::connect("redis://127.0.0.1:6379/").await?;
    /// let backend = RedisBackend::builder(policy).shares(Shares::new()).build(&redis)?;
    /// // Nothing acquired yet: nothing to report, and no call.
    /// assert!(backend.refresh_shares(SystemClock::new().now()).await);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn refresh_shares(&self, now: Instant) -> bool {
        let Some(table) = &self.inner.shares else { return false };
        table.group.refresh(Some(now), true, false).await
    }

    /// Test support: [`RedisBackend::refresh_shares`] whose replies are lost on the way
    /// back: Redis applies the refresh, this replica never learns its answer.
    #[cfg(feature = "test-support")]
    pub async fn refresh_shares_unheard(&self, now: Instant) -> bool {
        let Some(table) = &self.inner.shares else { return false };
        table.group.refresh(Some(now), false, false).await
    }

    /// Test support: the early refresh the background loop sends between two periods when
    /// scopes new to this replica turn hot (reach [`Shares::hot_after`](crate::Shares::hot_after)
    /// requests without a share): it refreshes those scopes only (of every backend of the
    /// group). Answers whether there were any.
    #[cfg(feature = "test-support")]
    pub async fn refresh_turned_hot(&self, now: Instant) -> bool {
        let Some(table) = &self.inner.shares else { return false };
        let any = table.group.has_turned_hot();
        table.group.refresh(Some(now), true, true).await;
        any
    }

    /// An acquisition through the shares: this replica's `table`.
    pub(in crate::backend) fn acquire_shared(
        &self,
        table: &Arc<Table>,
        key: &TenantKey,
        cost: u64,
        now: Instant,
    ) -> RedisAcquire {
        let inner = &self.inner;
        table.group.start(inner);
        match table.decide(inner, inner.keys_for(key), cost, now, true) {
            Local::Granted(grant) => {
                bump(&inner.stats.shared_grants);
                RedisAcquire::ready(Ok(RedisGrant { kind: GrantKind::Shared(grant) }))
            }
            Local::Refused { limit, wait, release } => {
                bump(&inner.stats.shared_refusals);
                RedisAcquire::ready(Err(inner.share_refusal(limit, wait, release)))
            }
            Local::Fetch(scopes) => {
                if inner.breaker.gate() == Gate::Open {
                    return RedisAcquire::ready(inner.unavailable(
                        key,
                        cost,
                        now,
                        "circuit open after repeated failures",
                    ));
                }
                let fetching = Fetching { table: table.clone(), scopes, sent: true };
                let fut = fetch_then_acquire(inner.clone(), key.clone(), cost, now, fetching);
                RedisAcquire::remote(Box::pin(fut), self.clone(), key.clone(), now)
            }
            Local::AwaitFetch(scopes, seen) => {
                let waiting = Fetching { table: table.clone(), scopes, sent: false };
                let fut = await_fetch_then_acquire(inner.clone(), key.clone(), cost, now, waiting, seen);
                RedisAcquire::remote(Box::pin(fut), self.clone(), key.clone(), now)
            }
            Local::Pool { local, cold } => {
                if let Some(cache) = &inner.refusals {
                    if let Some((i, retry, _, snapshot)) = crate::cache::lookup(cache, key, cost, now) {
                        table.undo(inner, &local);
                        bump(&inner.stats.cached_refusals);
                        let l = &inner.limits[i];
                        let refusal = LimitRefusal::new(l.name, l.tier_name, i, retry, false, snapshot);
                        return RedisAcquire::ready(Err(AcquireError::Refused(refusal)));
                    }
                }
                if inner.breaker.gate() == Gate::Open {
                    table.undo(inner, &local);
                    return RedisAcquire::ready(inner.unavailable(
                        key,
                        cost,
                        now,
                        "circuit open after repeated failures",
                    ));
                }
                let fut = take_from_pools(inner.clone(), table.clone(), key.clone(), cost, now, local, cold);
                RedisAcquire::remote(Box::pin(fut), self.clone(), key.clone(), now)
            }
        }
    }
}

impl Inner {
    fn share_refusal(&self, limit: usize, wait: Duration, release: bool) -> AcquireError {
        let l = &self.limits[limit];
        let snapshot = Snapshot { quota: l.quota, remaining: 0, reset: wait, window: l.window };
        AcquireError::Refused(LimitRefusal::new(l.name, l.tier_name, limit, wait, release, snapshot))
    }
}

/// Semaphore scopes whose share a request is fetching (`sent`) or waiting for another's
/// fetch of: their permits count in the demand the fetches report until it is answered,
/// fails or is dropped.
struct Fetching {
    table: Arc<Table>,
    scopes: Vec<(Arc<str>, u64)>,
    sent: bool,
}

impl Drop for Fetching {
    fn drop(&mut self) {
        self.table.fetched(&self.scopes, self.sent);
    }
}

/// A semaphore scope without a share, or whose share is too small for the request: one
/// call fetches its share (reporting the demand that made it ask: this request's permits
/// and those of the others fetching it), then the acquisition is decided again; still
/// short, one more. Short after both, every permit it could have is held elsewhere:
/// refused, and refused locally for two refresh periods unless a refresh grows the share
/// meanwhile.
async fn fetch_then_acquire(
    inner: Arc<Inner>,
    key: TenantKey,
    cost: u64,
    now: Instant,
    fetching: Fetching,
) -> Result<RedisGrant, AcquireError> {
    let table = fetching.table.clone();
    let mut fetching = Some(fetching);
    // Two fetches at most: a request admitted meanwhile from the share as it was before
    // this fetch's answer took a permit the fetch did not count; the second counts it.
    // When the first did not grow any share, no permit was free: the second is not sent.
    for fetch in 1..=2 {
        let Some(this) = fetching.take() else { break };
        let only: Vec<Arc<str>> = this.scopes.iter().map(|(k, _)| k.clone()).collect();
        let before: Vec<u64> = only.iter().map(|k| table.permits_of(k)).collect();
        let answered = inner.fetch_shares(&table, now, &only).await;
        drop(this);
        if !answered {
            return inner.unavailable(&key, cost, now, "the share of a semaphore could not be fetched");
        }
        let grew = || only.iter().zip(&before).any(|(k, b)| table.permits_of(k) > *b);
        let decided = table.decide(&inner, inner.keys_for(&key), cost, now, false);
        match answer_locally(&inner, &table, &key, cost, now, decided).await {
            Ok(answer) => return answer,
            Err(Unanswered::Await(still, _)) => {
                // (Not answered without `may_wait`.)
                table.fetched(&still, false);
                break;
            }
            Err(Unanswered::Fetch(still)) if fetch == 1 && grew() => {
                fetching = Some(Fetching { table: table.clone(), scopes: still, sent: true });
            }
            Err(Unanswered::Fetch(still)) => {
                table.fetched(&still, true);
                // Until the periodic refreshes, which report this demand, make room: a
                // fetch meanwhile would find the same permits held.
                table.deny(&still, now + table.settings.refresh * 2);
                bump(&inner.stats.shared_refusals);
                let limit =
                    still.first().and_then(|(k, _)| inner.keys_for(&key).iter().position(|x| **x == **k)).unwrap_or(0);
                return Err(inner.share_refusal(limit, Duration::ZERO, true));
            }
        }
    }
    inner.unavailable(&key, cost, now, "the share of a semaphore could not be fetched")
}

/// A decision that waits for a semaphore's share: a fetch to send, or one in flight to
/// wait for (the fetch count seen).
enum Unanswered {
    Fetch(Vec<(Arc<str>, u64)>),
    Await(Vec<(Arc<str>, u64)>, u64),
}

/// The answer to what the shares decided, when it needs no fetch: granted, refused, or
/// the pools' part asked for. A fetch to send or to wait for is handed back.
async fn answer_locally(
    inner: &Arc<Inner>,
    table: &Arc<Table>,
    key: &TenantKey,
    cost: u64,
    now: Instant,
    decided: Local,
) -> Result<Result<RedisGrant, AcquireError>, Unanswered> {
    match decided {
        Local::Granted(grant) => {
            bump(&inner.stats.shared_grants);
            Ok(Ok(RedisGrant { kind: GrantKind::Shared(grant) }))
        }
        Local::Refused { limit, wait, release } => {
            bump(&inner.stats.shared_refusals);
            Ok(Err(inner.share_refusal(limit, wait, release)))
        }
        Local::Pool { local, cold } => {
            Ok(take_from_pools(inner.clone(), table.clone(), key.clone(), cost, now, local, cold).await)
        }
        Local::Fetch(scopes) => Err(Unanswered::Fetch(scopes)),
        Local::AwaitFetch(scopes, seen) => Err(Unanswered::Await(scopes, seen)),
    }
}

/// A request whose semaphore scopes all have a fetch in flight: it waits for that fetch
/// (at most the call timeout), then decides again; finding another fetch in flight, it
/// waits once more (that one counts its permits), and after that fetches itself. A herd
/// of requests arriving before a tenant's first share so costs a few calls, not one each.
async fn await_fetch_then_acquire(
    inner: Arc<Inner>,
    key: TenantKey,
    cost: u64,
    now: Instant,
    waiting: Fetching,
    seen: u64,
) -> Result<RedisGrant, AcquireError> {
    let table = waiting.table.clone();
    let mut done = table.fetch_done.subscribe();
    let (mut waiting, mut seen) = (Some(waiting), seen);
    for round in 0..2 {
        // A fetch that outlives the timeout fails and is counted done; the bound is kept
        // here too.
        let _ = tokio::time::timeout(inner.settings.timeout, done.wait_for(|n| *n != seen)).await;
        drop(waiting.take());
        let decided = table.decide(&inner, inner.keys_for(&key), cost, now, round == 0);
        match answer_locally(&inner, &table, &key, cost, now, decided).await {
            Ok(answer) => return answer,
            Err(Unanswered::Fetch(scopes)) => {
                let fetching = Fetching { table: table.clone(), scopes, sent: true };
                return fetch_then_acquire(inner, key, cost, now, fetching).await;
            }
            Err(Unanswered::Await(scopes, again)) => {
                waiting = Some(Fetching { table: table.clone(), scopes, sent: false });
                seen = again;
            }
        }
    }
    inner.unavailable(&key, cost, now, "the share of a semaphore could not be fetched")
}

/// The pools' part of an acquisition: one call, all or nothing; the local parts are given
/// back if it refuses or fails.
async fn take_from_pools(
    inner: Arc<Inner>,
    table: Arc<Table>,
    key: TenantKey,
    cost: u64,
    now: Instant,
    local: Vec<Part>,
    cold: Vec<Part>,
) -> Result<RedisGrant, AcquireError> {
    // A thin rate's pool (never split: no share takes its rate) may book what it would
    // refuse: the replica then holds the units the pool refills next, and takes them with
    // no call once due (a thin rate several replicas ask for costs a call per unit, not
    // one per unit and replica).
    let thin = |p: &Part| {
        inner.limits[p.limit].share.is_some_and(|l| !l.window && !l.permits && l.burst < table.settings.min_burst)
    };
    let book = cold.len() == 1 && thin(&cold[0]);
    let mut args = if book {
        // (How long at least a booking is held once due, in place of the permits' lease.)
        table.args_head(&inner, "Q", now, table.settings.refresh)
    } else {
        table.args_head(&inner, "P", now, table.permit_lease)
    };
    let mut keys = Vec::with_capacity(cold.len());
    for part in &cold {
        let Some(l) = inner.limits[part.limit].share else { continue };
        keys.push(part.scope.clone());
        args.extend(pool_args(&l, part));
        args.push(part.units.to_string());
    }
    let give_back = |inner: &Inner| table.undo(inner, &local);
    let sent = tokio::time::Instant::now();
    let why = match inner.eval_shares(&table, &keys, &args).await {
        Ok(value) => match int_array(&value) {
            Some(reply) if book && reply.len() == 3 && reply[1] == 2 => {
                give_back(&inner);
                bump(&inner.stats.refused);
                let wait = Duration::from_micros(u64::try_from(reply[2]).unwrap_or(0));
                // Due no earlier than in Redis (counted from the answer; a manual clock is
                // the script's), held no later (counted from before the call).
                let hold = wait.max(table.settings.refresh);
                let late = if inner.settings.manual_clock { Duration::ZERO } else { sent.elapsed() };
                let from = now + wait + late;
                table.book(&cold[0].scope, cold[0].units, from, now + wait + hold);
                return Err(inner.share_refusal(cold[0].limit, Duration::from_nanos(from.nanos_since(now)), false));
            }
            Some(reply) if reply.get(1) == Some(&1) => {
                // A pool left without a unit refuses its next requests locally until it
                // refills one (a thin rate: the replica's next request, an instant later).
                for (part, &us) in cold.iter().zip(reply.iter().skip(2)) {
                    if let Ok(us @ 1..) = u64::try_from(us) {
                        table.pool_dry(&part.scope, now + Duration::from_micros(us));
                    }
                }
                bump(&inner.stats.granted);
                return Ok(RedisGrant { kind: GrantKind::Shared(SharedGrant { local, pooled: cold, charged: cost }) });
            }
            Some(reply) if reply.len() == 4 && reply[1] == 0 => {
                give_back(&inner);
                bump(&inner.stats.refused);
                let k = usize::try_from(reply[2] - 1).unwrap_or(0).min(cold.len() - 1);
                let limit = cold[k].limit;
                // No rate is free of shares (-1): the pool refills when a share ends or
                // shrinks. A window that is spent (-2): until it ends.
                let wait = match u64::try_from(reply[3]) {
                    Ok(us) => Duration::from_micros(us),
                    Err(_) if reply[3] == -2 => table.window_left(&cold[k].scope, now),
                    Err(_) => table.settings.refresh,
                };
                table.pool_dry(&cold[k].scope, now + wait);
                let refusal = inner.share_refusal(limit, wait, false);
                if let (Some(cache), AcquireError::Refused(r)) = (&inner.refusals, &refusal) {
                    let l = &inner.limits[limit];
                    let cached = CachedRefusal {
                        until: now + wait,
                        at: now,
                        cost,
                        counts_cost: l.counts == Counts::Cost,
                        limit,
                        needs_release: false,
                        snapshot: r.snapshot(),
                    };
                    cache.insert(&key, cached, |d| d.until <= now);
                }
                return Err(refusal);
            }
            _ => {
                bump(&inner.stats.errors);
                inner.failed();
                format!("unexpected reply {value:?}")
            }
        },
        Err(e) => e.message,
    };
    give_back(&inner);
    inner.unavailable(&key, cost, now, &why)
}

/// A pool call's arguments for `part` before its units: the limit, and a rate's period
/// and burst or a window's bounds (`start:end`, and -1).
fn pool_args(l: &ShareLimit, part: &Part) -> [String; 3] {
    if l.window {
        [l.amount.to_string(), format!("{}:{}", part.window, part.window_end), "-1".into()]
    } else {
        [l.amount.to_string(), l.period_us.to_string(), l.burst.to_string()]
    }
}
