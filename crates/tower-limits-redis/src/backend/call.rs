//! The request path: a tenant's keys, one `EVALSHA` (an `EVAL` after a `NOSCRIPT`) under
//! the timeout and the breaker, and the decision read from the script's integer reply.
//! What fails here goes to the failure policy; what is refused is cached until it frees.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use redis::Value;
use tokio::runtime::Handle;
use tower_limits_core::{
    AcquireError, CostAboveCapacity, Counts, Instant, KeyPart, LimitRefusal, LimitSnapshot, MissingTier, Snapshot,
    TenantKey, Unavailable,
};

use crate::cache::CachedRefusal;
use crate::failure::FailurePolicy;
use crate::keys::{SlotLayout, escape_part_into};

use super::background::{Op, spawn_op};
use super::builder::tag;
use super::grant::{GrantKind, RedisGrant, Remote};
use super::{EXACT, Inner, Lease};
use crate::stats::bump;

impl Inner {
    /// Whether releases of semaphore permits are on their way.
    fn releases_pending(&self) -> bool {
        self.releases_pending.load(std::sync::atomic::Ordering::Acquire) > 0
    }

    /// Completes when no release is on its way (settles may be).
    async fn releases_applied(&self) {
        until_zero(&self.releases_pending, &self.releases_done).await;
    }

    /// Completes when every background operation sent so far was applied or given up.
    pub(super) async fn background_idle(&self) {
        until_zero(&self.stats.background_pending, &self.idle).await;
    }

    pub(super) fn holder_id(&self, seq: u64) -> Arc<str> {
        format!("{:016x}.{seq:x}", self.instance).into()
    }

    pub(super) fn now_args(&self, now: Instant) -> (String, String) {
        if self.settings.manual_clock {
            let n = now.as_nanos();
            ((n / 1000).to_string(), (n % 1000).to_string())
        } else {
            (String::new(), String::new())
        }
    }

    /// Pushes the bounds of every calendar window's current period, in the order of the policy,
    /// as the script's clock counts: microseconds of the caller's clock with a test
    /// clock, of the Unix epoch (where the server's `TIME` counts) otherwise.
    pub(super) fn push_calendar_args(&self, now: Instant, args: &mut Vec<String>) {
        for w in self.limits.iter().filter_map(|l| l.calendar.as_ref()) {
            let (start, end) = if self.settings.manual_clock {
                let (s, e) = w.period_at(now);
                (i128::from(s.as_nanos()), i128::from(e.as_nanos()))
            } else {
                w.unix_period_at(now)
            };
            // Below 2^53 microseconds (the year 2255) the script counts them exactly.
            let us = |n: i128| n.div_euclid(1000).clamp(0, (1 << 53) - 1).to_string();
            args.push(us(start));
            args.push(us(end));
        }
    }

    /// The keys of every limit of the set for `key`, in the order of the policy.
    pub(super) fn keys_for(&self, key: &TenantKey) -> Vec<String> {
        let mut heads: [Option<String>; tower_limits_core::MAX_TIERS] = Default::default();
        let mut keys = Vec::with_capacity(self.limits.len());
        for l in self.limits.iter() {
            let mut k = String::with_capacity(64);
            match l.tier {
                None => {
                    k.push_str(&self.namespace);
                    k.push_str(":{");
                    k.push_str(tag(&self.layout));
                    k.push('}');
                    if let SlotLayout::OneSlot(_) = self.layout {
                        k.push_str(":*");
                    }
                }
                Some(t) => {
                    let head = heads[t].get_or_insert_with(|| self.tenant_head(key, t));
                    k.push_str(head);
                }
            }
            k.push_str(&l.suffix);
            keys.push(k);
        }
        keys
    }

    pub(super) fn tenant_head(&self, key: &TenantKey, tier: usize) -> String {
        let mut k = String::with_capacity(48);
        k.push_str(&self.namespace);
        k.push(':');
        match &self.layout {
            SlotLayout::PerTenant => {
                k.push('{');
                escape_part_into(&mut k, key.part(0).unwrap_or(KeyPart::Text("")));
                k.push('}');
            }
            SlotLayout::OneSlot(tag) => {
                k.push('{');
                k.push_str(tag);
                k.push_str("}:");
                escape_part_into(&mut k, key.part(0).unwrap_or(KeyPart::Text("")));
            }
        }
        for part in key.parts().skip(1).take(tier) {
            k.push('/');
            escape_part_into(&mut k, part);
        }
        k
    }

    /// The refusals decided without Redis.
    pub(super) fn local_refusal(&self, key: &TenantKey, cost: u64) -> Option<AcquireError> {
        let depth = key.depth();
        if self.depth_needed > depth {
            return Some(AcquireError::MissingTier(MissingTier::new(self.tiers[depth])));
        }
        self.limits.iter().find_map(|l| {
            let c = if l.counts == Counts::Cost { cost } else { 1 };
            (c > l.capacity)
                .then(|| AcquireError::CostAboveCapacity(CostAboveCapacity::new(l.name, l.tier_name, c, l.capacity)))
        })
    }

    pub(super) fn snapshot_of(&self, i: usize, remaining: i64, reset: i64, now: Instant) -> LimitSnapshot {
        let l = &self.limits[i];
        // A calendar period's length varies (a month, a day across a clock change).
        let window = l.calendar.as_ref().map_or(l.window, |w| Duration::from_nanos(w.period_len_at(now)));
        LimitSnapshot {
            name: l.name,
            tier: l.tier_name,
            counts: l.counts,
            is_semaphore: l.is_semaphore,
            snapshot: Snapshot {
                quota: l.quota,
                remaining: u64::try_from(remaining).unwrap_or(0),
                reset: Duration::from_nanos(u64::try_from(reset).unwrap_or(0)),
                window,
            },
        }
    }

    /// One call of a script: `EVALSHA`, and after `NOSCRIPT` one `EVAL`.
    async fn eval<K: redis::ToRedisArgs, A: redis::ToRedisArgs>(
        &self,
        (sha, source): (&str, &str),
        keys: &[K],
        args: &[A],
    ) -> redis::RedisResult<Value> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(sha).arg(keys.len()).arg(keys).arg(args);
        bump(&self.stats.round_trips);
        match self.conn.query(&cmd).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                bump(&self.stats.script_loads);
                bump(&self.stats.round_trips);
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(source).arg(keys.len()).arg(keys).arg(args);
                self.conn.query(&cmd).await
            }
            other => other,
        }
    }

    /// One call of the set's script under the timeout, feeding the breaker.
    pub(super) async fn call<A: redis::ToRedisArgs + Sync>(
        &self,
        keys: &[String],
        args: &[A],
    ) -> Result<Value, CallError> {
        self.guarded(self.eval((&self.sha, &self.source), keys, args)).await
    }

    /// One call of another script under the timeout, feeding the breaker.
    pub(super) async fn call_script(
        &self,
        sha: &str,
        source: &str,
        keys: &[&str],
        args: &[String],
    ) -> Result<Value, CallError> {
        self.guarded(self.eval((sha, source), keys, args)).await
    }

    /// One plain command under the timeout, feeding the breaker.
    pub(super) async fn command(&self, cmd: &redis::Cmd) -> Result<Value, CallError> {
        bump(&self.stats.round_trips);
        self.guarded(self.conn.query(cmd)).await
    }

    async fn guarded(&self, call: impl Future<Output = redis::RedisResult<Value>>) -> Result<Value, CallError> {
        match tokio::time::timeout(self.settings.timeout, call).await {
            Ok(Ok(value)) => {
                self.breaker.success();
                Ok(value)
            }
            Ok(Err(e)) => {
                bump(&self.stats.errors);
                #[cfg(feature = "metrics")]
                crate::metrics::failure(crate::metrics::LIMITS, "error");
                self.failed();
                let sent = !(e.is_connection_refusal() || e.kind() == redis::ErrorKind::ClusterConnectionNotFound);
                tracing::debug!(target: "tower_limits_redis", error = %e, "redis call failed");
                Err(CallError { message: e.to_string(), maybe_applied: sent })
            }
            Err(_) => {
                bump(&self.stats.timeouts);
                #[cfg(feature = "metrics")]
                crate::metrics::failure(crate::metrics::LIMITS, "timeout");
                self.failed();
                Err(CallError { message: format!("no answer within {:?}", self.settings.timeout), maybe_applied: true })
            }
        }
    }

    pub(super) fn failed(&self) {
        if self.breaker.failure() {
            bump(&self.stats.breaker_opened);
            #[cfg(feature = "metrics")]
            crate::metrics::circuit_opened(crate::metrics::LIMITS);
        }
    }

    /// The failure policy's answer.
    pub(super) fn unavailable(
        &self,
        key: &TenantKey,
        cost: u64,
        now: Instant,
        why: &str,
    ) -> Result<RedisGrant, AcquireError> {
        bump(&self.stats.unavailable);
        // The state last read from Redis is no longer known: headers must not claim it.
        if let Some(map) = &self.snapshots {
            map.with(key, |m| m.remove(key));
        }
        match (&self.settings.failure, &self.fallback) {
            (FailurePolicy::FailOpen, _) => {
                bump(&self.stats.fail_open_admits);
                #[cfg(feature = "metrics")]
                crate::metrics::unavailable("fail_open");
                Ok(RedisGrant { kind: GrantKind::Open })
            }
            (FailurePolicy::Fallback { .. }, Some(local)) => {
                #[cfg(feature = "metrics")]
                crate::metrics::unavailable("fallback");
                bump(&self.stats.fallback_acquisitions);
                local.acquire_grant(key, cost, now).map(|g| RedisGrant { kind: GrantKind::Local(g) }).map_err(|e| {
                    match e {
                        // The local share's state is not the fleet's: the refusal keeps its wait
                        // and states no quota (a snapshot of quota 0 stands for no state).
                        AcquireError::Refused(d) => AcquireError::Refused(LimitRefusal::new(
                            d.limit(),
                            d.tier(),
                            d.limit_index(),
                            d.retry_after(),
                            d.needs_release(),
                            Snapshot { quota: 0, remaining: 0, reset: d.retry_after(), window: Duration::ZERO },
                        )),
                        other => other,
                    }
                })
            }
            _ => {
                #[cfg(feature = "metrics")]
                crate::metrics::unavailable("fail_closed");
                Err(AcquireError::Unavailable(Unavailable::new(format!("redis: {why}"))))
            }
        }
    }

    /// Turns the script's reply into a grant or a refusal. A reply carries every limit's
    /// state after the first six integers, except a grant's brief reply (`b`: granted,
    /// `now_us`, `now_sub`), asked for when no peek cache wants the states.
    pub(super) fn decide(
        &self,
        key: &TenantKey,
        cost: u64,
        now: Instant,
        holder: u64,
        id: Arc<str>,
        reply: &[i64],
    ) -> Result<RedisGrant, AcquireError> {
        let n = self.limits.len();
        let snapshot = |i: usize| self.snapshot_of(i, reply[6 + 2 * i], reply[7 + 2 * i], now);
        let at = |v: i64| u64::try_from(v).unwrap_or(0);
        let result = if reply[0] == 1 {
            bump(&self.stats.granted);
            if self.has_semaphore && !self.settings.manual_clock {
                self.hold_lease(key, holder, &id, cost);
            }
            Ok(RedisGrant {
                kind: GrantKind::Remote(Remote {
                    us: at(reply[1]),
                    sub: at(reply[2]),
                    holder,
                    id,
                    acquired: cost,
                    charged: cost,
                    after: None,
                }),
            })
        } else {
            bump(&self.stats.refused);
            let i = usize::try_from(reply[3]).unwrap_or(0).min(n - 1);
            let l = &self.limits[i];
            let retry = Duration::from_nanos(at(reply[4]));
            let needs_release = reply[5] == 1;
            let snapshot = snapshot(i).snapshot;
            if let Some(cache) = &self.refusals {
                // A budget may be refunded by another replica long before its period
                // ends, which a refusal remembered to the end would not see: a calendar
                // window's refusals are asked again every time.
                if !retry.is_zero() && l.calendar.is_none() {
                    let refusal = CachedRefusal {
                        until: now + retry,
                        at: now,
                        cost,
                        counts_cost: l.counts == Counts::Cost,
                        limit: i,
                        needs_release,
                        snapshot,
                    };
                    cache.insert(key, refusal, |d| d.until <= now);
                }
            }
            Err(AcquireError::Refused(LimitRefusal::new(l.name, l.tier_name, i, retry, needs_release, snapshot)))
        };
        if let Some(map) = &self.snapshots {
            if reply.len() == FULL + 2 * n {
                map.insert(key, (now, (0..n).map(snapshot).collect()), |_| true);
            }
        }
        result
    }

    pub(super) fn hold_lease(&self, key: &TenantKey, holder: u64, id: &Arc<str>, acquired: u64) {
        let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
        if leases.len() < self.settings.max_leases {
            let lease = Lease { key: key.clone(), id: id.clone(), acquired, since: tokio::time::Instant::now() };
            leases.insert(holder, lease);
        }
    }

    pub(super) fn drop_lease(&self, holder: u64) {
        self.leases.lock().unwrap_or_else(PoisonError::into_inner).remove(&holder);
    }

    pub(super) fn handle(&self) -> Option<Handle> {
        Handle::try_current().ok().or_else(|| self.runtime.get().cloned())
    }
}

#[derive(Debug)]
pub(super) struct CallError {
    pub(super) message: String,
    /// Whether the script may have run (the call was sent): a charge must then not be
    /// sent again.
    pub(super) maybe_applied: bool,
}

/// The integers a reply starts with: granted, `now_us`, `now_sub`, the blocking limit, the
/// wait, whether a release is needed; two per limit follow.
const FULL: usize = 6;
/// A brief grant: granted, `now_us`, `now_sub`.
const BRIEF: usize = 3;

/// A reply of integers only.
pub(super) fn int_array(value: &Value) -> Option<Vec<i64>> {
    let Value::Array(items) = value else { return None };
    items.iter().map(|v| if let Value::Int(i) = v { Some(*i) } else { None }).collect()
}

/// The script's reply as integers: a full one, or a brief grant.
fn ints(value: &Value, n: usize) -> Option<Vec<i64>> {
    let Value::Array(items) = value else { return None };
    let brief = items.len() == BRIEF && matches!(items.first(), Some(Value::Int(1)));
    if items.len() != FULL + 2 * n && !brief {
        return None;
    }
    items.iter().map(|v| if let Value::Int(i) = v { Some(*i) } else { None }).collect()
}

/// The remote part of an acquisition.
/// Completes when `count` is zero; whoever brings it to zero notifies `zero`.
async fn until_zero(count: &std::sync::atomic::AtomicU64, zero: &tokio::sync::Notify) {
    loop {
        let notified = std::pin::pin!(zero.notified());
        let mut notified = notified;
        notified.as_mut().enable();
        if count.load(std::sync::atomic::Ordering::Acquire) == 0 {
            return;
        }
        notified.await;
    }
}

pub(super) async fn acquire_remote(
    inner: Arc<Inner>,
    key: TenantKey,
    cost: u64,
    now: Instant,
    holder: u64,
) -> Result<RedisGrant, AcquireError> {
    let keys = inner.keys_for(&key);
    let cost_arg = cost.min(EXACT).to_string();
    let id = inner.holder_id(holder);
    // The limits' states come back only for the peek cache (and with every refusal).
    let op = if inner.snapshots.is_some() { "a" } else { "b" };
    let mut waited_for_releases = false;
    let why = loop {
        // Releases on their way when the acquisition is sent may reach Redis after it.
        let releases_behind = inner.releases_pending();
        let result = if inner.has_calendar {
            let mut args = if inner.settings.manual_clock {
                let (us, sub) = inner.now_args(now);
                vec![op.to_owned(), us, sub]
            } else {
                vec![op.to_owned()]
            };
            args.push(cost_arg.clone());
            args.push(id.to_string());
            inner.push_calendar_args(now, &mut args);
            inner.call(&keys, &args).await
        } else if inner.settings.manual_clock {
            let (us, sub) = inner.now_args(now);
            inner.call(&keys, &[op, &us, &sub, &cost_arg, &id]).await
        } else if inner.records_holders {
            inner.call(&keys, &[op, &cost_arg, &id]).await
        } else {
            inner.call(&keys, &[op, &cost_arg]).await
        };
        match result {
            Ok(value) => match ints(&value, inner.limits.len()) {
                Some(reply) => {
                    // A full semaphore while this replica still sends releases: one of
                    // them may be the permit this request's client just gave back (its
                    // answer ended, the release is on its way). Wait for them, once,
                    // and ask again, rather than refuse below the limit.
                    let semaphore_full = reply[0] != 1 && reply[5] == 1;
                    if semaphore_full && !waited_for_releases && (releases_behind || inner.releases_pending()) {
                        waited_for_releases = true;
                        bump(&inner.stats.release_waits);
                        // Bounded: a release retried while Redis is away must not hold
                        // the request for its whole retry window.
                        let bound = inner.settings.timeout.saturating_mul(4).max(Duration::from_secs(1));
                        let _ = tokio::time::timeout(bound, inner.releases_applied()).await;
                        continue;
                    }
                    return inner.decide(&key, cost, now, holder, id, &reply);
                }
                None => {
                    bump(&inner.stats.errors);
                    #[cfg(feature = "metrics")]
                    crate::metrics::failure(crate::metrics::LIMITS, "error");
                    inner.failed();
                    tracing::warn!(target: "tower_limits_redis", reply = ?value, "unexpected reply from the limit script");
                    break format!("unexpected reply {value:?}");
                }
            },
            Err(e) => {
                // It may have been granted: give back the concurrency it may hold.
                if e.maybe_applied && inner.has_semaphore {
                    let op = Op { id, now, us: 0, sub: 0, acquired: cost, req: (1, 1), cost: (0, 0), release: true };
                    spawn_op(&inner, key.clone(), op, None, None);
                }
                break e.message;
            }
        }
    };
    inner.unavailable(&key, cost, now, &why)
}
