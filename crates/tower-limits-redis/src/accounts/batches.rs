//! The background task that sends a store's settles, cancels and reports in batches.

use std::sync::atomic::Ordering;

use std::time::Duration;

use tokio::sync::mpsc;

use super::{Inner, Op, signed};

/// The most operations one background call carries.
const BATCH: usize = 64;

/// How long a settle, cancel or correction waits for an acquisition to ride on before a
/// background call sends it.
const LINGER: Duration = Duration::from_millis(10);

/// Sends the queued operations in batches while the store lives.
pub(super) async fn send_batches(weak: std::sync::Weak<Inner>, mut rx: mpsc::UnboundedReceiver<Op>) {
    let mut batch = Vec::with_capacity(BATCH);
    // While Redis is away every batch fails: one warning every few seconds says so, with
    // how many it stands for.
    let warnings = crate::throttle::Throttle::new();
    while rx.recv_many(&mut batch, BATCH).await > 0 {
        if batch.iter().any(|op| matches!(op, Op::Ride)) {
            tokio::time::sleep(LINGER).await;
        }
        let Some(inner) = weak.upgrade() else { return };
        let mut args = Vec::with_capacity(1 + 5 * batch.len());
        args.push("b".to_owned());
        let mut flushes = Vec::new();
        // What no acquisition carried meanwhile.
        for fields in inner.take_riders() {
            args.extend(fields.iter().map(i64::to_string));
        }
        for op in batch.drain(..) {
            let fields = match op {
                Op::Adjust { member, requests, cost } => [1, member as i64 + 1, requests, cost, 0],
                Op::Report { member, retry_us, requests, tokens } => [2, member as i64 + 1, retry_us, requests, tokens],
                Op::Replace { member, limit, interval, tolerance, lowered } => [
                    if lowered { 3 } else { 5 },
                    member as i64 + 1,
                    limit as i64 + 1,
                    signed(interval),
                    signed(tolerance),
                ],
                Op::Flush(done) => {
                    flushes.push(done);
                    continue;
                }
                Op::Ride => continue,
            };
            args.extend(fields.iter().map(i64::to_string));
        }
        if args.len() > 1 {
            inner.stats.batch_calls.fetch_add(1, Ordering::Relaxed);
            inner.stats.batched_ops.fetch_add(((args.len() - 1) / 5) as u64, Ordering::Relaxed);
            let answer = inner.call(&args).await;
            if matches!(answer, Ok(redis::Value::Int(-1))) {
                // No replaced limit on record: Redis lost them.
                inner.replace_again();
            }
            if let Err(e) = answer {
                if let Some(suppressed) = warnings.warn_now() {
                    tracing::warn!(
                        target: "tower_limits_redis",
                        error = %e,
                        suppressed,
                        "a batch of account settles and reports may not have been applied"
                    );
                }
            }
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}
