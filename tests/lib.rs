//! Shared support for the integration tests in `tests/tests/`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proptest::test_runner::{Config, FileFailurePersistence};
use tower_limits_core::{AcquireError, Backend, Grant, Instant, LimitSet, LimitSnapshot, Observed, Quota, TenantKey};

/// A proptest configuration running `cases` cases, that keeps failing cases next to the
/// test file as `tests/tests/<file>.proptest-regressions` (proptest's default would put
/// them in a `proptest-regressions/` directory at the workspace root, because this crate
/// has a `lib.rs`). Commit those files: they are replayed first on every run.
#[must_use]
pub fn proptest_config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..Config::default()
    }
}

/// A comparable description of why an acquisition was refused: the kind, and for a
/// refusal the blocking limit, the exact wait, whether a release is needed and the
/// snapshot. (`AcquireError` is not `PartialEq`: a refusal holds the set's config.)
#[must_use]
pub fn describe(error: &AcquireError) -> String {
    match error {
        AcquireError::Refused(d) => format!(
            "refused by #{} {:?} (tier {:?}) retry {:?} release {} {:?}",
            d.limit_index(),
            d.limit(),
            d.tier(),
            d.retry_after(),
            d.needs_release(),
            d.snapshot()
        ),
        AcquireError::CostAboveCapacity(e) => format!("{e:?}"),
        AcquireError::MissingTier(e) => format!("{e:?}"),
        AcquireError::KeyTableFull(e) => format!("{e:?}"),
        other => format!("other: {other}"),
    }
}

/// The snapshots of every limit for every key, at `now`.
#[must_use]
pub fn peek_all(set: &LimitSet, keys: &[TenantKey], now: Instant) -> Vec<Vec<LimitSnapshot>> {
    keys.iter().map(|k| set.peek(k, now)).collect()
}

/// `amount` per `period` with a burst of `burst`, for quotas of computed numbers (a
/// constant one is `Quota::per_second(nz!(10)).burst(nz!(5))`).
///
/// # Panics
/// When the numbers make no valid quota (see `Quota::try_new` and `Quota::try_burst`).
#[must_use]
pub fn quota(amount: u64, period: Duration, burst: u64) -> Quota {
    Quota::try_new(amount, period)
        .and_then(|q| q.try_burst(burst))
        .unwrap_or_else(|e| panic!("{amount} per {period:?} with a burst of {burst}: {e}"))
}

/// Tenant keys from `["org", "user"]` pairs.
///
/// # Panics
/// On an invalid key.
#[must_use]
pub fn keys(pairs: &[[&str; 2]]) -> Vec<TenantKey> {
    pairs.iter().map(|p| TenantKey::new(*p).expect("a valid key")).collect()
}

/// A small deterministic generator (xorshift64): a test's random program is the same on
/// every run and every backend. The seed must not be zero.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// A number from `lo` to `hi`, both included.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// Parameters of the algorithms for the property laws, and their strategies.
pub mod params {
    use std::time::Duration;

    use proptest::prelude::*;
    use tower_limits_core::Quota;
    use tower_limits_core::algorithm::{FixedWindow, Gcra, SlidingWindowCounter, SlidingWindowLog, TokenBucket};

    /// `amount` per `period` nanoseconds, with a burst. The period is at least a hundred
    /// times the amount, so that every rate is representable (its rounding costs under 1%),
    /// and is rarely a multiple of the amount, so that rounding the interval up matters.
    #[derive(Debug, Clone, Copy)]
    pub struct RateParams {
        /// Units per period.
        pub amount: u64,
        /// The period in nanoseconds.
        pub period: u64,
        /// The burst.
        pub burst: u64,
    }

    impl RateParams {
        /// The quota: the rate and the burst.
        pub fn quota(self) -> Quota {
            super::quota(self.amount, Duration::from_nanos(self.period), self.burst)
        }

        /// The emission interval, rounded up as the core documents.
        pub fn interval(self) -> u64 {
            self.period.div_ceil(self.amount)
        }

        /// A GCRA of these parameters.
        pub fn gcra(self) -> Gcra {
            Gcra::new(self.quota())
        }

        /// A token bucket of these parameters.
        pub fn bucket(self) -> TokenBucket {
            TokenBucket::new(self.quota())
        }
    }

    /// Rates that are representable, rarely a whole number of nanoseconds per unit.
    pub fn rate_params() -> impl Strategy<Value = RateParams> {
        (1u64..=20, 1u64..=20).prop_flat_map(|(amount, burst)| {
            (amount * 100..=amount * 1_000_000).prop_map(move |period| RateParams { amount, period, burst })
        })
    }

    /// `limit` per `window` nanoseconds; windows as short as one nanosecond.
    #[derive(Debug, Clone, Copy)]
    pub struct WindowParams {
        /// The most per window.
        pub limit: u64,
        /// The window in nanoseconds.
        pub window: u64,
    }

    impl WindowParams {
        /// A step of the clock comparable to the time one unit of the limit takes.
        pub fn unit(self) -> u64 {
            (self.window / self.limit).max(1)
        }

        /// A sliding log of these parameters.
        pub fn log(self) -> SlidingWindowLog {
            SlidingWindowLog::new(self.limit, Duration::from_nanos(self.window)).expect("valid")
        }

        /// A sliding counter of these parameters.
        pub fn counter(self) -> SlidingWindowCounter {
            SlidingWindowCounter::new(self.limit, Duration::from_nanos(self.window)).expect("valid")
        }

        /// A fixed window of these parameters.
        pub fn fixed(self) -> FixedWindow {
            FixedWindow::new(self.limit, Duration::from_nanos(self.window)).expect("valid")
        }
    }

    /// Windows from one nanosecond to ten milliseconds.
    pub fn window_params() -> impl Strategy<Value = WindowParams> {
        (1u64..=20, prop_oneof![1 => 1u64..=16, 4 => 1u64..=10_000_000])
            .prop_map(|(limit, window)| WindowParams { limit, window })
    }
}

pub mod policies {
    //! Random limit policies for the property laws: the one generator of the tests.
    //!
    //! A [`Spec`] describes one limit (its algorithm, the tier it is keyed by, whether it
    //! counts requests or cost, and its numbers); a [`PolicyGen`] says which specs to draw;
    //! [`policy_of`] makes a set's policy of them, with the tiers [`TIERS`].
    //!
    //! `PolicyGen::new()` draws from everything: every algorithm, every tier, either way of
    //! counting, rates of 1 to 5 per 5 to 60 ms with bursts (and limits, and capacities) of 1
    //! to 6. A caller narrows it to what its law needs, for example:
    //!
    //! - rate limits only, where a refusal must have a wait: `.kinds(Kind::RATES)`;
    //! - small limits, so that a known cost is above every capacity: `.sizes(1..=4)`;
    //! - a rate of `size` per period with a burst of `size`: `.amount_is_size()`;
    //! - global limits only, or keyed ones: `.tiers(&[Tier::Global])`;
    //! - limits that all count cost: `.counting(Counting::Cost)`.
    //!
    //! The draw of one spec is a tuple in a fixed order (kind, tier, counting, amount, size,
    //! period), so that a setting the caller keeps draws as before, and the regression seeds
    //! of `limit_set_laws.rs` (drawn with `PolicyGen::new()`) replay the same cases.

    use std::ops::RangeInclusive;
    use std::time::Duration;

    use proptest::prelude::*;
    use tower_limits_core::{LimitPolicy, LimitSetPolicy};

    /// The tiers of every set [`policy_of`] makes, outermost first.
    pub const TIERS: [&str; 2] = ["org", "user"];

    /// The most a generated semaphore holds: a semaphore's capacity is its size, at most
    /// this, so that a few permits fill it.
    pub const SEMAPHORE_MAX: u64 = 4;

    /// The algorithm of a limit.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Kind {
        /// `LimitPolicy::gcra`.
        Gcra,
        /// `LimitPolicy::token_bucket`.
        TokenBucket,
        /// `LimitPolicy::sliding_window_log`.
        SlidingLog,
        /// `LimitPolicy::sliding_window_counter`.
        SlidingCounter,
        /// `LimitPolicy::fixed_window`.
        FixedWindow,
        /// `LimitPolicy::semaphore`.
        Semaphore,
    }

    impl Kind {
        /// Every algorithm.
        pub const ALL: &'static [Kind] = &[
            Kind::Gcra,
            Kind::TokenBucket,
            Kind::SlidingLog,
            Kind::SlidingCounter,
            Kind::FixedWindow,
            Kind::Semaphore,
        ];

        /// The rate limits: every algorithm but the semaphore.
        pub const RATES: &'static [Kind] =
            &[Kind::Gcra, Kind::TokenBucket, Kind::SlidingLog, Kind::SlidingCounter, Kind::FixedWindow];
    }

    /// What a limit is keyed by: nothing (one state for everyone), or one of [`TIERS`].
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Tier {
        /// One state for the whole set.
        Global,
        /// A state per `org`.
        Org,
        /// A state per `user` (of an org).
        User,
    }

    impl Tier {
        /// Every scope.
        pub const ALL: &'static [Tier] = &[Tier::Global, Tier::Org, Tier::User];

        /// The keyed scopes.
        pub const KEYED: &'static [Tier] = &[Tier::Org, Tier::User];

        /// The tier's name, `None` for a global limit.
        #[must_use]
        pub fn name(self) -> Option<&'static str> {
            match self {
                Tier::Global => None,
                Tier::Org => Some(TIERS[0]),
                Tier::User => Some(TIERS[1]),
            }
        }
    }

    /// How the generated limits count.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Counting {
        /// Each limit counts requests or cost, at random.
        Either,
        /// Every limit counts requests (one per acquisition, whatever its cost).
        Requests,
        /// Every limit counts cost.
        Cost,
    }

    /// One limit of a random policy.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Spec {
        /// The algorithm.
        pub kind: Kind,
        /// What it is keyed by.
        pub tier: Tier,
        /// Whether it counts cost rather than requests.
        pub counts_cost: bool,
        /// The rate's amount (GCRA and the token bucket).
        pub amount: u64,
        /// The burst, limit or capacity (see [`Spec::capacity`]).
        pub size: u64,
        /// The rate's period or the window, in milliseconds.
        pub period_ms: u64,
    }

    impl Spec {
        /// The limit, named `name`.
        #[must_use]
        pub fn policy(&self, name: impl Into<String>) -> LimitPolicy {
            let name = name.into();
            let period = Duration::from_millis(self.period_ms);
            let p = match self.kind {
                Kind::Gcra => LimitPolicy::gcra(name, super::quota(self.amount, period, self.size)),
                Kind::TokenBucket => LimitPolicy::token_bucket(name, super::quota(self.amount, period, self.size)),
                Kind::SlidingLog => LimitPolicy::sliding_window_log(name, self.size, period),
                Kind::SlidingCounter => LimitPolicy::sliding_window_counter(name, self.size, period),
                Kind::FixedWindow => LimitPolicy::fixed_window(name, self.size, period),
                Kind::Semaphore => LimitPolicy::semaphore(name, self.capacity()),
            };
            let p = match self.tier.name() {
                None => p,
                Some(tier) => p.per(tier),
            };
            if self.counts_cost { p.counting_cost() } else { p }
        }

        /// The most it grants at once: what `remaining` reads when nothing is used.
        #[must_use]
        pub fn capacity(&self) -> u64 {
            if self.kind == Kind::Semaphore { self.size.min(SEMAPHORE_MAX) } else { self.size }
        }

        /// What a grant of `cost` holds of this limit until it is released: nothing
        /// unless it is a semaphore.
        #[must_use]
        pub fn holds(&self, cost: u64) -> u64 {
            match (self.kind, self.counts_cost) {
                (Kind::Semaphore, true) => cost,
                (Kind::Semaphore, false) => 1,
                _ => 0,
            }
        }

        /// Whether it keeps a state per key (and so takes room in the key table).
        #[must_use]
        pub fn is_keyed(&self) -> bool {
            self.tier != Tier::Global
        }
    }

    /// Which specs to draw; see [the module](self) for the default and the settings.
    #[derive(Debug, Clone)]
    pub struct PolicyGen {
        kinds: &'static [Kind],
        tiers: &'static [Tier],
        counting: Counting,
        /// `None`: the amount is the size.
        amounts: Option<RangeInclusive<u64>>,
        sizes: RangeInclusive<u64>,
        periods_ms: RangeInclusive<u64>,
    }

    impl Default for PolicyGen {
        fn default() -> Self {
            PolicyGen {
                kinds: Kind::ALL,
                tiers: Tier::ALL,
                counting: Counting::Either,
                amounts: Some(1..=5),
                sizes: 1..=6,
                periods_ms: 5..=60,
            }
        }
    }

    impl PolicyGen {
        /// Everything: every algorithm, every tier, either way of counting, amounts 1 to
        /// 5, sizes 1 to 6, periods and windows of 5 to 60 ms.
        #[must_use]
        pub fn new() -> Self {
            Self::default()
        }

        /// Only these algorithms (for example [`Kind::RATES`]).
        #[must_use]
        pub fn kinds(mut self, kinds: &'static [Kind]) -> Self {
            assert!(!kinds.is_empty(), "at least one algorithm");
            self.kinds = kinds;
            self
        }

        /// Only these scopes (for example `&[Tier::Global]`, or [`Tier::KEYED`]).
        #[must_use]
        pub fn tiers(mut self, tiers: &'static [Tier]) -> Self {
            assert!(!tiers.is_empty(), "at least one scope");
            self.tiers = tiers;
            self
        }

        /// How the limits count.
        #[must_use]
        pub fn counting(mut self, counting: Counting) -> Self {
            self.counting = counting;
            self
        }

        /// Rates' amounts from this range, drawn apart from the burst.
        #[must_use]
        pub fn amounts(mut self, amounts: RangeInclusive<u64>) -> Self {
            assert!(*amounts.start() >= 1, "a rate's amount is at least one");
            self.amounts = Some(amounts);
            self
        }

        /// A rate's amount is its burst: `size` per period, with a burst of `size`.
        #[must_use]
        pub fn amount_is_size(mut self) -> Self {
            self.amounts = None;
            self
        }

        /// Bursts, limits and capacities (at most [`SEMAPHORE_MAX`] for a semaphore) from
        /// this range.
        #[must_use]
        pub fn sizes(mut self, sizes: RangeInclusive<u64>) -> Self {
            assert!(*sizes.start() >= 1, "a limit admits at least one");
            self.sizes = sizes;
            self
        }

        /// Periods and windows from this range, in milliseconds.
        #[must_use]
        pub fn periods_ms(mut self, periods_ms: RangeInclusive<u64>) -> Self {
            assert!(*periods_ms.start() >= 1, "a period is at least a millisecond");
            self.periods_ms = periods_ms;
            self
        }

        /// One limit.
        pub fn spec(&self) -> BoxedStrategy<Spec> {
            let counts_cost = match self.counting {
                Counting::Either => any::<bool>().boxed(),
                Counting::Requests => Just(false).boxed(),
                Counting::Cost => Just(true).boxed(),
            };
            let amount = match &self.amounts {
                Some(amounts) => amounts.clone().prop_map(Some).boxed(),
                None => Just(None).boxed(),
            };
            (
                prop::sample::select(self.kinds),
                prop::sample::select(self.tiers),
                counts_cost,
                amount,
                self.sizes.clone(),
                self.periods_ms.clone(),
            )
                .prop_map(|(kind, tier, counts_cost, amount, size, period_ms)| Spec {
                    kind,
                    tier,
                    counts_cost,
                    amount: amount.unwrap_or(size),
                    size,
                    period_ms,
                })
                .boxed()
        }

        /// `len` limits, drawn apart.
        pub fn specs(&self, len: RangeInclusive<usize>) -> BoxedStrategy<Vec<Spec>> {
            prop::collection::vec(self.spec(), len).boxed()
        }
    }

    /// A set's policy of `specs`, named `l0`, `l1`, ... in order, with the tiers
    /// [`TIERS`] and room for `max_keys` states.
    #[must_use]
    pub fn policy_of(specs: &[Spec], max_keys: usize) -> LimitSetPolicy {
        specs
            .iter()
            .enumerate()
            .fold(LimitSetPolicy::new().tiers(TIERS).max_keys(max_keys), |p, (i, s)| p.limit(s.policy(name(i))))
    }

    /// The name [`policy_of`] gives the limit at `index`.
    #[must_use]
    pub fn name(index: usize) -> String {
        format!("l{index}")
    }
}

/// The workspace README, whose Rust snippets are compiled (and, but for servers, run)
/// as doctests of this crate: a snippet that would not compile for a user fails CI.
#[doc = include_str!("../README.md")]
mod readme {}

/// An in-memory backend that counts what is asked of it: acquisitions (`acquired`, the
/// observed ones included) and peeks (`peeked`).
#[derive(Clone, Debug)]
pub struct Counting {
    /// The limits deciding.
    pub set: LimitSet,
    /// Acquisitions asked.
    pub acquired: Arc<AtomicUsize>,
    /// Peeks asked.
    pub peeked: Arc<AtomicUsize>,
}

impl Counting {
    /// Counts what is asked of `set`, from zero.
    #[must_use]
    pub fn new(set: LimitSet) -> Counting {
        Counting { set, acquired: Arc::default(), peeked: Arc::default() }
    }

    /// Acquisitions asked so far.
    #[must_use]
    pub fn acquisitions(&self) -> usize {
        self.acquired.load(Ordering::SeqCst)
    }

    /// Peeks asked so far.
    #[must_use]
    pub fn peeks(&self) -> usize {
        self.peeked.load(Ordering::SeqCst)
    }
}

impl Backend for Counting {
    type Grant = Grant;
    type Acquire = std::future::Ready<Result<Grant, AcquireError>>;

    fn acquire(&self, key: &TenantKey, cost: u64, now: Instant) -> Self::Acquire {
        self.acquired.fetch_add(1, Ordering::SeqCst);
        std::future::ready(self.set.acquire_grant(key, cost, now))
    }

    fn settle(&self, key: &TenantKey, grant: &mut Grant, actual: u64, now: Instant) {
        self.set.settle_grant(key, grant, actual, now);
    }

    fn release(&self, key: &TenantKey, grant: Grant) {
        self.set.release_grant(key, grant);
    }

    fn cancel(&self, key: &TenantKey, grant: Grant, now: Instant) {
        self.set.cancel_grant(key, grant, now);
    }

    fn peek(&self, key: &TenantKey, now: Instant) -> Vec<LimitSnapshot> {
        self.peeked.fetch_add(1, Ordering::SeqCst);
        self.set.peek(key, now)
    }

    fn acquire_observed(&self, key: &TenantKey, cost: u64, now: Instant) -> Observed<Self> {
        self.acquired.fetch_add(1, Ordering::SeqCst);
        let (granted, seen) = self.set.acquire_observed(key, cost, now);
        Observed::ready(granted, seen)
    }
}
