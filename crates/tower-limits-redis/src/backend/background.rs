//! After the grant: settles, releases and cancels run as background tasks on the
//! acquisition's runtime, in the order of each grant's settles; a release is retried
//! until Redis answers (it is idempotent), a charge that may have been applied is never
//! sent twice. The renewal task keeps this replica's semaphore leases alive.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::oneshot;
use tower_limits_core::{Instant, TenantKey};

use crate::failure::Gate;

use super::{EXACT, Inner};
use crate::stats::bump;
use crate::throttle::Throttle;

/// A settle, release or cancel of one grant, as the script's `s` operation takes it.
#[derive(Debug, Clone)]
pub(super) struct Op {
    pub(super) id: Arc<str>,
    /// The caller's now (used only with a manual clock).
    pub(super) now: Instant,
    pub(super) us: u64,
    pub(super) sub: u64,
    pub(super) acquired: u64,
    /// Limits counting requests: from, to.
    pub(super) req: (u64, u64),
    /// Limits counting cost: from, to.
    pub(super) cost: (u64, u64),
    pub(super) release: bool,
}

impl Op {
    pub(super) fn adjusts(&self) -> bool {
        self.req.0 != self.req.1 || self.cost.0 != self.cost.1
    }
}

/// Tracks one background operation in the pending count, even if its task is dropped.
pub(super) struct PendingGuard(Arc<Inner>);

impl PendingGuard {
    /// Counts one more background operation until the guard drops.
    pub(super) fn new(inner: &Arc<Inner>) -> PendingGuard {
        inner.stats.background_pending.fetch_add(1, Ordering::AcqRel);
        PendingGuard(inner.clone())
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        if self.0.stats.background_pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Counts one release on its way until the guard drops: an acquisition refused by a full
/// semaphore while one is asks again once it arrived.
pub(super) struct ReleaseGuard(Arc<Inner>);

impl ReleaseGuard {
    fn new(inner: &Arc<Inner>) -> ReleaseGuard {
        inner.releases_pending.fetch_add(1, Ordering::AcqRel);
        ReleaseGuard(inner.clone())
    }
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        if self.0.releases_pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.releases_done.notify_waiters();
        }
    }
}

/// Runs `op` in the background: after `after` (the grant's previous settle), retried while
/// Redis is away when that cannot apply it twice.
pub(super) fn spawn_op(
    inner: &Arc<Inner>,
    key: TenantKey,
    op: Op,
    after: Option<oneshot::Receiver<()>>,
    done: Option<oneshot::Sender<()>>,
) {
    let Some(handle) = inner.handle() else {
        bump(&inner.stats.background_failures);
        tracing::warn!(target: "tower_limits_redis", "no tokio runtime to send a release or settle on");
        return;
    };
    let guard = PendingGuard::new(inner);
    let release = op.release.then(|| ReleaseGuard::new(inner));
    handle.spawn(async move {
        let _release = release;
        let inner = &guard.0;
        if let Some(after) = after {
            let _ = after.await;
        }
        run_op(inner, &key, op).await;
        if let Some(done) = done {
            let _ = done.send(());
        }
        drop(guard);
    });
}

async fn run_op(inner: &Inner, key: &TenantKey, mut op: Op) {
    let keys = inner.keys_for(key);
    let retry_for = inner.settings.lease.max(Duration::from_secs(1));
    let deadline = tokio::time::Instant::now() + retry_for;
    let mut backoff = Duration::from_millis(10);
    loop {
        // Sent even while the breaker is open (the breaker spares the request path, and
        // the backoff bounds these): sent now, a release (and the settle it waits for)
        // reaches Redis before any acquisition sent later on the connection. Held back,
        // the holds of requests that ended during a stall outlived it and refused new
        // requests until the release's backoff ran out.
        {
            let n = |v: u64| v.min(EXACT).to_string();
            let acq = n(op.acquired);
            let sent = if op.release && !op.adjusts() {
                match inner.lone_request_semaphore.and_then(|i| keys.get(i)) {
                    // A release alone of the one semaphore, counting requests: its member.
                    Some(held) => inner.command(redis::cmd("ZREM").arg(held).arg(format!("{}:1", op.id))).await,
                    // A release alone: the script's short operation.
                    None => inner.call(&keys, &["r", &op.id, &acq]).await,
                }
            } else {
                let (now_us, now_sub) = inner.now_args(op.now);
                let (us, sub) = (n(op.us), n(op.sub));
                let (rq0, rq1, c0, c1) = (n(op.req.0), n(op.req.1), n(op.cost.0), n(op.cost.1));
                let release = if op.release { "1" } else { "0" };
                let args = ["s", &now_us, &now_sub, &op.id, &us, &sub, &acq, &rq0, &rq1, &c0, &c1, release];
                inner.call(&keys, &args).await
            };
            match sent {
                Ok(_) => {
                    bump(&inner.stats.background_ops);
                    return;
                }
                Err(e) if e.maybe_applied => {
                    if !op.release {
                        bump(&inner.stats.background_failures);
                        if let Some(suppressed) = UNAPPLIED.warn_now() {
                            tracing::warn!(
                                target: "tower_limits_redis",
                                error = %e.message,
                                suppressed,
                                "a settle may not have been applied"
                            );
                        }
                        return;
                    }
                    // Only the idempotent part is sent again.
                    op.req = (op.req.1, op.req.1);
                    op.cost = (op.cost.1, op.cost.1);
                }
                Err(_) => {}
            }
        }
        if tokio::time::Instant::now() + backoff > deadline {
            bump(&inner.stats.background_failures);
            if let Some(suppressed) = GAVE_UP.warn_now() {
                tracing::warn!(
                    target: "tower_limits_redis",
                    release = op.release,
                    suppressed,
                    "redis stayed unavailable: gave up a background operation (semaphore holds expire with their lease)"
                );
            }
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// While Redis is away every background operation fails: one warning of each kind every
/// few seconds, however many backends, with how many it stands for.
static UNAPPLIED: Throttle = Throttle::new();
static GAVE_UP: Throttle = Throttle::new();
/// Renews the leases of this replica's grants every third of the lease, while the backend
/// lives.
pub(super) async fn renew_leases(weak: Weak<Inner>, every: Duration) {
    let mut tick = crate::periodic::ticks(every, every);
    loop {
        tick.tick().await;
        let Some(inner) = weak.upgrade() else { return };
        let due: Vec<(TenantKey, Arc<str>, u64)> = {
            let mut leases = inner.leases.lock().unwrap_or_else(PoisonError::into_inner);
            let max_hold = inner.settings.max_hold;
            leases.retain(|_, l| l.since.elapsed() < max_hold);
            leases.values().map(|l| (l.key.clone(), l.id.clone(), l.acquired)).collect()
        };
        for (key, id, acquired) in due {
            if inner.breaker.gate() == Gate::Open {
                break;
            }
            let keys = inner.keys_for(&key);
            let acq = acquired.min(EXACT).to_string();
            if inner.call(&keys, &["n", "", "", &id, &acq]).await.is_ok() {
                bump(&inner.stats.leases_renewed);
            }
        }
    }
}
