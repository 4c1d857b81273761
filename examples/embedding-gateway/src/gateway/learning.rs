//! The accounts' limits learned from the upstream's answers.
//!
//! Each account's mirror starts from its declared quota (`rpm`, `tpm`). Every answer's
//! `x-ratelimit-limit-requests` and `x-ratelimit-limit-tokens` (the account's quota per
//! window, as the provider states it) and every `429` feed one
//! [`QuotaLearner`](tower_limits::core::learn::QuotaLearner) per quota: a stated limit
//! below the learned one lowers it at once, a `429` lowers it by a tenth, and it rises
//! by a quarter a window towards the stated limit, never above
//! `mirror.learn_ceiling_percent` of the declared quota (100% by default: it then only
//! lowers, and recovers up to what was declared). When a learned quota changes, the
//! account's mirror is rebuilt from it with the same formula as at start
//! ([`Account::mirror_policy_for`]) and replaces the old one, keeping its state.
//!
//! A lowered quota also meets what the upstream still counts: the calls of its last
//! window, sent at the old pace, may already hold more than the new quota. Each account
//! keeps the calls answered over its last window and jitter (their requests and
//! tokens); when a quota is lowered, the new mirror is charged so that it decides as if
//! those calls had been admitted at its own pace, back to back from the start of that
//! span: it admits again once the upstream's window has room, rather than meeting the
//! upstream's `429`s until it drains.
//!
//! With Redis the mirrors live in the shared accounts, built with
//! [`replaceable_limits`](tower_limits_redis::RedisAccountsBuilder::replaceable_limits):
//! each replica learns from the answers it receives, and a learned quota replaces the
//! account's mirror for the whole fleet
//! ([`RedisAccounts::replace_member_limits`]); Redis charges a lowered mirror with what
//! the whole fleet admitted over the window and jitter, so that it waits for what the
//! upstream still counts of every replica's calls. Replicas see
//! the same stated limits and so learn the same quotas; a `429` lowers the fleet's mirror
//! through the replica that met it. The replica's local mirror, which decides only while
//! Redis is away, is rebuilt at its share (`1 / replicas`) of the learned quota. Leased
//! accounts take a replaced quota at each replica's next lease refresh.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tower_limits::core::learn::{LearnSettings, QuotaLearner};
use tower_limits::core::policy::Counts;
use tower_limits::{Instant, LimitPool, Snapshot, TenantKey, UpstreamReport};
use tower_limits_redis::RedisAccounts;

use crate::config::{Account, Config, MirrorSettings};

/// What is learned of one account: its two quotas, and (in memory) the calls answered
/// over its last window and jitter (when, and their tokens).
struct Learned {
    quotas: [QuotaLearner; 2],
    recent: VecDeque<(Instant, u64)>,
}

/// The learners of every account, by its place in the pool.
pub(crate) struct Learning {
    accounts: Vec<(Account, Mutex<Learned>)>,
    mirror: MirrorSettings,
    max_request_tokens: u64,
    /// The shared accounts, once this replica reached Redis.
    shared: Mutex<Option<RedisAccounts>>,
    /// The replicas the local mirrors are a share of (1 in memory).
    replicas: AtomicU64,
}

impl std::fmt::Debug for Learning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Learning").field("learned", &self.learned()).finish_non_exhaustive()
    }
}

impl Learning {
    /// Learners for `config`'s accounts, whose local mirrors are a share of `replicas`;
    /// `None` when `mirror.learn_ceiling_percent` is 0.
    pub(crate) fn new(config: &Config, replicas: u64) -> Option<Self> {
        let ceiling = config.mirror.learn_ceiling_percent;
        if ceiling == 0 {
            return None;
        }
        let settings = LearnSettings::new().ceiling_percent(ceiling);
        let accounts = config
            .accounts
            .iter()
            .map(|a| {
                let requests = QuotaLearner::new(a.requests_per_window(), a.window, settings);
                let tokens = QuotaLearner::new(a.tokens_per_window(), a.window, settings);
                (a.clone(), Mutex::new(Learned { quotas: [requests, tokens], recent: VecDeque::new() }))
            })
            .collect();
        Some(Learning {
            accounts,
            mirror: config.mirror,
            max_request_tokens: config.gateway.max_request_tokens,
            shared: Mutex::new(None),
            replicas: AtomicU64::new(replicas.max(1)),
        })
    }

    /// From now on, learned quotas replace the mirrors of `store` for the fleet.
    pub(crate) fn share_through(&self, store: RedisAccounts) {
        *self.shared.lock().unwrap_or_else(PoisonError::into_inner) = Some(store);
    }

    /// The local mirrors are now a share of `replicas`.
    pub(crate) fn set_replicas(&self, replicas: u64) {
        self.replicas.store(replicas.max(1), Ordering::Relaxed);
    }

    /// One answer of the account at `index`, to a call of `tokens`: learns from it, and
    /// when a quota moved, rebuilds the account's mirror in `pool`.
    pub(crate) fn observe(
        &self,
        pool: &LimitPool<Account>,
        index: usize,
        report: &UpstreamReport,
        refused: bool,
        tokens: u64,
        now: Instant,
    ) {
        let Some((account, learned)) = self.accounts.get(index) else { return };
        // With Redis, the fleet's recent calls are counted there.
        let shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let mut learned = learned.lock().unwrap_or_else(PoisonError::into_inner);
        // The calls the upstream may still count: its window and the jitter.
        let span = account.window + self.mirror.jitter;
        if shared.is_none() {
            if !refused {
                learned.recent.push_back((now, tokens));
            }
            while learned.recent.front().is_some_and(|(at, _)| now.saturating_since(*at) > span) {
                learned.recent.pop_front();
            }
        }
        let before = (learned.quotas[0].learned(), learned.quotas[1].learned());
        let moved_requests = learned.quotas[0].observe(report.limit_requests, refused, now);
        let moved_tokens = learned.quotas[1].observe(report.limit_tokens, refused, now);
        if moved_requests.is_none() && moved_tokens.is_none() {
            return;
        }
        let (requests, tokens) = (learned.quotas[0].learned(), learned.quotas[1].learned());
        let used = (learned.recent.len() as u64, learned.recent.iter().map(|(_, t)| t).sum::<u64>());
        drop(learned);
        if let Some(store) = shared {
            // The fleet's mirror is the whole account's (Redis charges a lowered one with
            // what the fleet admitted over the span); this replica's is its share.
            match account.mirror_policy_for(requests, tokens, &self.mirror, self.max_request_tokens, 1) {
                Ok(whole) => match store.replace_member_limits(index, &whole, now) {
                    Ok(()) => tracing::info!(
                        account = %account.name,
                        requests,
                        tokens,
                        "account limits learned from the upstream: the fleet's mirror replaced"
                    ),
                    Err(e) => {
                        tracing::warn!(account = %account.name, error = %e, "learned limits refused by the shared accounts")
                    }
                },
                Err(why) => {
                    tracing::warn!(account = %account.name, requests, tokens, %why, "learned limits too small for a mirror: kept the last one");
                    return;
                }
            }
            let replicas = self.replicas.load(Ordering::Relaxed);
            if let (Ok(share), Some(set)) = (
                account.mirror_policy_for(requests, tokens, &self.mirror, self.max_request_tokens, replicas),
                pool.member_set(index),
            ) {
                if let Err(e) = set.replace_policy(share) {
                    tracing::warn!(account = %account.name, error = %e, "learned limits refused by the local mirror");
                }
            }
            return;
        }
        let policy = match account.mirror_policy_for(requests, tokens, &self.mirror, self.max_request_tokens, 1) {
            Ok(policy) => policy,
            Err(why) => {
                tracing::warn!(account = %account.name, requests, tokens, %why, "learned limits too small for a mirror: kept the last one");
                return;
            }
        };
        let Some(set) = pool.member_set(index) else { return };
        match set.replace_policy(policy) {
            Ok(()) => {
                // A lowered quota: what the upstream still counts, at the new pace.
                for (lowered, counts, amount) in
                    [(requests < before.0, Counts::Requests, used.0), (tokens < before.1, Counts::Cost, used.1)]
                {
                    if lowered {
                        charge_recent(set, counts, amount, span, now);
                    }
                }
                tracing::info!(
                account = %account.name,
                requests,
                tokens,
                declared_requests = account.requests_per_window(),
                declared_tokens = account.tokens_per_window(),
                    "account limits learned from the upstream: mirror rebuilt"
                );
            }
            Err(e) => tracing::warn!(account = %account.name, error = %e, "learned limits refused by the mirror"),
        }
    }

    /// Each account's learned quotas per window: requests, tokens.
    pub(crate) fn learned(&self) -> Vec<(u64, u64)> {
        self.accounts
            .iter()
            .map(|(_, l)| {
                let l = l.lock().unwrap_or_else(PoisonError::into_inner);
                (l.quotas[0].learned(), l.quotas[1].learned())
            })
            .collect()
    }
}

/// Charges the mirror `set`'s limit counting `counts` so that it decides as if `used`
/// had been admitted at its own pace from `span` ago: its debt becomes at least
/// `used × interval - span`, what it would be had those calls gone through it.
fn charge_recent(set: &tower_limits::LimitSet, counts: Counts, used: u64, span: Duration, now: Instant) {
    let global = TenantKey::global();
    let Some(limit) = set.peek(&global, now).into_iter().find(|s| s.counts == counts && !s.is_semaphore) else {
        return;
    };
    let Snapshot { quota, window, reset, .. } = limit.snapshot;
    if quota == 0 || window.is_zero() {
        return;
    }
    // The mirror's interval, and the debt those calls would leave (beyond what it holds).
    let interval = window.as_secs_f64() / quota as f64;
    let target = used as f64 * interval - span.as_secs_f64();
    let missing = target - reset.as_secs_f64();
    if missing > 0.0 {
        set.charge_usage(&global, counts, (missing / interval).ceil() as u64, now);
    }
}
