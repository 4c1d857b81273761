//! The named layers: one per limit type, each a door to the same middleware.
//!
//! | layer | limit | constructor |
//! |---|---|---|
//! | [`GcraLayer`] | GCRA: a rate with a burst, the exact "virtual scheduling" meter | `GcraLayer::new(Quota::per_second(nz!(100)).burst(nz!(20)))` |
//! | [`TokenBucketLayer`] | a bucket of `burst` tokens refilled at the rate | `TokenBucketLayer::new(Quota::per_minute(nz!(6_000)))` |
//! | [`LeakyBucketLayer`] | a shaper: requests wait and leave at a steady pace | `LeakyBucketLayer::new(Quota::per_second(nz!(10)))` |
//! | [`SlidingWindowLayer`] | at most `amount` in any window of `period`, exact (a log) or approximate (two counters) | `SlidingWindowLayer::new(Quota::per_minute(nz!(1_000)))` |
//! | [`FixedWindowLayer`] | at most `amount` per calendar-aligned window | `FixedWindowLayer::new(Quota::per_day(nz!(50_000)))` |
//! | [`CalendarWindowLayer`] | at most `limit` per calendar day, week, month or year in a time zone: budgets | `CalendarWindowLayer::new(nz!(100_000_000), CalendarPeriod::Month, "Europe/Berlin")?` |
//! | [`SemaphoreLayer`] | at most `capacity` in flight, weighted by cost | `SemaphoreLayer::new(nz!(64))` |
//! | [`LimitSetLayer`] | several limits, all or nothing, keyed by tenant tiers | `LimitSetLayer::new(policy)?` |
//! | [`FairQueueLayer`](crate::FairQueueLayer) | a weighted-fair tenant queue in front of shared capacity | `FairQueueLayer::concurrency(config, 64)?` |
//!
//! Each named layer is a [`LimitSetLayer`] of one limit: the same engine, the same
//! service ([`LimitService`](crate::LimitService)), the same response future and the same
//! builder verbs ([`key`](LimitLayer::key), [`cost`](LimitLayer::cost),
//! [`usage`](LimitLayer::usage), [`wait`](LimitLayer::wait),
//! [`refuse_with`](LimitLayer::refuse_with), ...). Only the constructor differs,
//! chosen by the type's last parameter, a [`door`]. A constant limit is a [`Quota`]
//! (or a [`NonZeroU64`](std::num::NonZeroU64)), so building one cannot fail (but for a
//! calendar window's time zone, looked up by name in the bundled database); limits
//! read from data go through [`LimitSetPolicy`], whose errors name
//! the field.
//!
//! A named layer starts global: one state shared by every request. Given a key
//! extractor ([`PeerIp`](crate::extract::PeerIp), a tenant from the request's
//! extensions, a closure), its limit holds per key instead. Every rate limit counts the
//! request's cost ([`cost`](LimitLayer::cost), one by default), so the same layer
//! limits requests or tokens.
//!
//! ```
//! use tower::ServiceBuilder;
//! use tower_limits::extract::PeerIp;
//! use tower_limits::http::HttpAnswer;
//! use tower_limits::{GcraLayer, Quota, SemaphoreLayer, nz};
//!
//! let layers = ServiceBuilder::new()
//!     .layer(SemaphoreLayer::new(nz!(64)).refuse_with(HttpAnswer::new()))
//!     .layer(GcraLayer::new(Quota::per_second(nz!(10)).burst(nz!(5))).key(PeerIp).refuse_with(HttpAnswer::new()));
//! let app: axum::Router = axum::Router::new().route("/", axum::routing::get(|| async { "hello" })).layer(layers);
//! # drop(app);
//! ```

mod calendar_window;
mod fixed_window;
mod gcra;
mod leaky_bucket;
mod limit_set;
mod semaphore;
mod sliding_window;
mod token_bucket;

pub use calendar_window::CalendarWindowLayer;
pub use fixed_window::FixedWindowLayer;
pub use gcra::GcraLayer;
pub use leaky_bucket::LeakyBucketLayer;
pub use limit_set::LimitSetLayer;
pub use semaphore::SemaphoreLayer;
pub use sliding_window::SlidingWindowLayer;
pub use token_bucket::TokenBucketLayer;
use tower_limits_core::{LimitPolicy, LimitSet, LimitSetPolicy};

pub use crate::shell::LimitLayer;
use crate::shell::shared::{Settings, Shared, Source};
use crate::{LayerClock, Quota};

/// The doors: marker types that pick a [`LimitLayer`]'s constructors. They have no
/// values and change nothing at run time.
pub mod door {
    /// A door of [`LimitLayer`](super::LimitLayer). Sealed.
    pub trait Door: sealed::Sealed + 'static {
        /// The layer's name, as its `Debug` output shows it.
        const NAME: &'static str;
    }

    mod sealed {
        pub trait Sealed {}
    }

    macro_rules! doors {
        ($($(#[$doc:meta])* $door:ident => $name:literal),* $(,)?) => {$(
            $(#[$doc])*
            #[derive(Debug)]
            pub enum $door {}
            impl sealed::Sealed for $door {}
            impl Door for $door {
                const NAME: &'static str = $name;
            }
        )*};
    }

    doors! {
        /// [`LimitSetLayer`](super::LimitSetLayer): a set of limits from a policy.
        Set => "LimitSetLayer",
        /// [`GcraLayer`](super::GcraLayer).
        Gcra => "GcraLayer",
        /// [`TokenBucketLayer`](super::TokenBucketLayer).
        TokenBucket => "TokenBucketLayer",
        /// [`LeakyBucketLayer`](super::LeakyBucketLayer).
        LeakyBucket => "LeakyBucketLayer",
        /// [`SlidingWindowLayer`](super::SlidingWindowLayer).
        SlidingWindow => "SlidingWindowLayer",
        /// [`FixedWindowLayer`](super::FixedWindowLayer).
        FixedWindow => "FixedWindowLayer",
        /// [`CalendarWindowLayer`](super::CalendarWindowLayer).
        CalendarWindow => "CalendarWindowLayer",
        /// [`SemaphoreLayer`](super::SemaphoreLayer).
        Semaphore => "SemaphoreLayer",
    }
}

/// A layer of one global limit that counts cost, per key once it is given a key.
fn single<D>(
    limit: LimitPolicy,
    settings: Settings,
) -> LimitLayer<crate::extract::Extractors, crate::ReturnError, LimitSet, D> {
    let policy = LimitSetPolicy::new().limit(limit.counting_cost());
    // A quota is valid by construction, and one global limit is a valid set.
    let set = LimitSet::new(policy.clone()).unwrap_or_else(|e| unreachable!("a quota always builds: {e}"));
    let mut shared = Shared::new(set, LayerClock::default(), settings);
    shared.source = Some(Source::single(policy));
    LimitLayer::from_shared(shared)
}

/// The window of a quota: its amount per its period.
fn window(quota: Quota) -> (u64, std::time::Duration) {
    (quota.amount(), quota.period())
}
