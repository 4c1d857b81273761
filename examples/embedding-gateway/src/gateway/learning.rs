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
//! In memory only: with Redis the mirrors live in the shared store, and each replica's
//! local one is only the failure policy's share.

use std::sync::{Mutex, PoisonError};

use tower_limits::core::learn::{LearnSettings, QuotaLearner};
use tower_limits::{Instant, LimitPool, UpstreamReport};

use crate::config::{Account, Config, MirrorSettings};

/// The learners of every account, by its place in the pool.
pub(crate) struct Learning {
    accounts: Vec<(Account, Mutex<[QuotaLearner; 2]>)>,
    mirror: MirrorSettings,
    max_request_tokens: u64,
}

impl std::fmt::Debug for Learning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Learning").field("learned", &self.learned()).finish_non_exhaustive()
    }
}

impl Learning {
    /// Learners for `config`'s accounts; `None` when `mirror.learn_ceiling_percent` is 0.
    pub(crate) fn new(config: &Config) -> Option<Self> {
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
                (a.clone(), Mutex::new([requests, tokens]))
            })
            .collect();
        Some(Learning { accounts, mirror: config.mirror, max_request_tokens: config.gateway.max_request_tokens })
    }

    /// One answer of the account at `index`: learns from it, and when a quota moved,
    /// rebuilds the account's mirror in `pool`.
    pub(crate) fn observe(
        &self,
        pool: &LimitPool<Account>,
        index: usize,
        report: &UpstreamReport,
        refused: bool,
        now: Instant,
    ) {
        let Some((account, learners)) = self.accounts.get(index) else { return };
        let mut learners = learners.lock().unwrap_or_else(PoisonError::into_inner);
        let requests = learners[0].observe(report.limit_requests, refused, now);
        let tokens = learners[1].observe(report.limit_tokens, refused, now);
        if requests.is_none() && tokens.is_none() {
            return;
        }
        let (requests, tokens) = (learners[0].learned(), learners[1].learned());
        drop(learners);
        let policy = match account.mirror_policy_for(requests, tokens, &self.mirror, self.max_request_tokens, 1) {
            Ok(policy) => policy,
            Err(why) => {
                tracing::warn!(account = %account.name, requests, tokens, %why, "learned limits too small for a mirror: kept the last one");
                return;
            }
        };
        match pool.member_set(index).map(|set| set.replace_policy(policy)) {
            Some(Ok(())) => tracing::info!(
                account = %account.name,
                requests,
                tokens,
                declared_requests = account.requests_per_window(),
                declared_tokens = account.tokens_per_window(),
                "account limits learned from the upstream: mirror rebuilt"
            ),
            Some(Err(e)) => tracing::warn!(account = %account.name, error = %e, "learned limits refused by the mirror"),
            None => {}
        }
    }

    /// Each account's learned quotas per window: requests, tokens.
    pub(crate) fn learned(&self) -> Vec<(u64, u64)> {
        self.accounts
            .iter()
            .map(|(_, l)| {
                let l = l.lock().unwrap_or_else(PoisonError::into_inner);
                (l[0].learned(), l[1].learned())
            })
            .collect()
    }
}
