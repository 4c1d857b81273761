//! What a grant is: the plain [`Grant`], and the [`Permit`] and [`OwnedPermit`] that give
//! it back on drop.
//!
//! A grant remembers what the set needs to correct it later: the instant it was made at,
//! the policy version it was made under (a settle after a replace maps it by name), the
//! costs acquired and those last settled to. Rate limits need nothing on drop; a grant
//! refers to its policy's shape (interned, no reference count) only when the policy has
//! semaphores or a shadow limit refused it, so that a release after a replace still
//! finds the semaphores and the refusals can be named. A permit borrows or owns the set
//! and the key and releases on drop; a bare `Grant` leaves that duty with its holder.

use std::fmt;

use super::LimitSet;
use crate::key::TenantKey;
use crate::limit::{LimitDef, Shape};
use crate::policy::Counts;
use crate::table::Place;
use crate::time::Instant;

/// Per-limit costs of one acquisition.
#[derive(Debug, Clone)]
pub(super) enum Costs {
    /// One per request for limits counting requests, this for limits counting cost.
    Uniform(u64),
    /// Explicit, per limit.
    Each(Box<[u64]>),
}

impl Costs {
    #[inline]
    pub(super) fn of(&self, i: usize, def: &LimitDef) -> u64 {
        self.counting(i, def.counts)
    }

    /// The cost of limit `i`, which counts `counts`.
    #[inline]
    pub(super) fn counting(&self, i: usize, counts: Counts) -> u64 {
        match self {
            Costs::Uniform(cost) => Costs::uniform_counting(*cost, counts),
            Costs::Each(costs) => costs.get(i).copied().unwrap_or(u64::MAX),
        }
    }

    /// What one cost `cost` charges a limit counting `counts`.
    #[inline]
    pub(super) fn uniform_counting(cost: u64, counts: Counts) -> u64 {
        match counts {
            Counts::Requests => 1,
            Counts::Cost => cost,
        }
    }
}

/// A grant as plain data: what the set needs to settle and release it later.
///
/// [`Permit`] and [`OwnedPermit`] wrap one and give it back on drop; a `Grant` on its own
/// does not. Code that keeps the key elsewhere (a layer's response future, a backend)
/// holds a `Grant` and must hand it back to [`LimitSet::release_grant`] or
/// [`LimitSet::cancel_grant`] exactly once, or the concurrency it holds is lost.
#[must_use = "a grant holds concurrency until it is released"]
#[derive(Debug)]
pub struct Grant {
    pub(super) granted_at: Instant,
    pub(super) version: u64,
    /// Kept only when the policy has semaphores (so that a release after a policy change
    /// can still find them by name) or a shadow limit refused it.
    pub(super) shape: Option<&'static Shape>,
    /// The one cost acquired (what semaphores release) and the one cost rate limits are
    /// charged now (the last settle's, or the cost acquired), while `each` is `None`.
    /// Held inline, so that a grant of one cost, settled or not, owns nothing on the heap
    /// and dropping it is a test of `shape` and of `each`.
    pub(super) acquired: u64,
    pub(super) charged: u64,
    /// The costs when any of them is per limit (`acquire_each`, `settle_each`); then it
    /// rules, and the two fields above are not read.
    pub(super) each: Option<Box<EachCosts>>,
    /// The limits in shadow mode that would have refused it, one bit per limit (in the
    /// order of the policy it was granted under): they were not charged, so nothing is
    /// released, settled or refunded on them.
    pub(crate) shadowed: u16,
    /// Where the policy's one keyed semaphore holds this grant's permits, for a release
    /// with no lookup.
    pub(super) held: HeldAt,
}

/// Where a grant's permits of the policy's one keyed semaphore are held: the key's shard
/// and the state's place in its table, packed in 32 bits (zero for none, as for a grant
/// that created the state, or of a policy with other semaphores), so that a release finds
/// the state with no hash and no probe. A hint, not a promise: the release confirms
/// under the shard's lock that the grant's policy is still the current one and that the
/// state at that place is the key's (the table may have grown since and moved it), and
/// looks the key up otherwise. Kept in the grant's padding: a grant stays 56 bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct HeldAt(u32);

/// Bits of a [`HeldAt`]: the table (plus one; zero for none), the shard, the bucket.
const TABLE_BITS: u32 = 2;
const SHARD_BITS: u32 = 7;
const BUCKET_SHIFT: u32 = TABLE_BITS + SHARD_BITS;
const _: () = assert!(super::shard::MAX_SHARDS <= 1 << SHARD_BITS, "every shard's number fits");

impl HeldAt {
    /// No place kept: the release looks the key up.
    pub(super) const NONE: HeldAt = HeldAt(0);

    /// The place `place` in shard `shard`; none when either does not fit (a shard's table
    /// of more than eight million buckets).
    #[inline]
    pub(super) fn new(shard: usize, place: Place) -> HeldAt {
        let (table, bucket) = place.parts();
        if shard >= 1 << SHARD_BITS || bucket >= 1 << (32 - BUCKET_SHIFT) {
            return HeldAt::NONE;
        }
        // Each part checked to fit above: the casts lose nothing.
        #[allow(clippy::cast_possible_truncation)]
        HeldAt((bucket as u32) << BUCKET_SHIFT | (shard as u32) << TABLE_BITS | (u32::from(table) + 1))
    }

    /// The shard and the place, if kept.
    #[inline]
    pub(super) fn get(self) -> Option<(usize, Place)> {
        let table = self.0 & ((1 << TABLE_BITS) - 1);
        let shard = (self.0 >> TABLE_BITS) & ((1 << SHARD_BITS) - 1);
        let place = Place::from_parts(u8::try_from(table.checked_sub(1)?).ok()?, (self.0 >> BUCKET_SHIFT) as usize)?;
        Some((shard as usize, place))
    }
}

/// A grant's costs once one of them is per limit.
#[derive(Debug)]
pub(super) struct EachCosts {
    acquired: Costs,
    charged: Costs,
}

/// What the engine answers on a grant; the caller adds the key and costs it already has.
pub(super) struct Granted {
    pub(super) granted_at: Instant,
    pub(super) version: u64,
    pub(super) shape: Option<&'static Shape>,
    pub(super) shadowed: u16,
    pub(super) held: HeldAt,
}

impl Grant {
    /// A grant of nothing at `now`, of any policy version: what a correction made outside
    /// any request (an upstream's report, usage recorded elsewhere) is applied through.
    pub(super) fn probe(now: Instant) -> Grant {
        Grant {
            granted_at: now,
            version: super::ANY_VERSION,
            shape: None,
            acquired: 0,
            charged: 0,
            each: None,
            shadowed: 0,
            held: HeldAt::NONE,
        }
    }

    /// The instant the grant was made at.
    #[must_use]
    pub fn granted_at(&self) -> Instant {
        self.granted_at
    }

    /// Whether releasing it gives anything back (the set has semaphores); when not,
    /// dropping the grant loses nothing.
    #[must_use]
    pub fn holds_concurrency(&self) -> bool {
        self.shape.is_some_and(|s| s.has_semaphore)
    }

    /// The limits in shadow mode that would have refused this grant (see
    /// [`LimitPolicy::shadow`](crate::LimitPolicy::shadow)), by name and tier, in the
    /// order of the policy. They were not charged.
    ///
    /// ```
    /// use tower_limits_core::{Instant, LimitPolicy, LimitSet, LimitSetPolicy, Quota, TenantKey, nz};
    ///
    /// let set = LimitSet::new(
    ///     LimitSetPolicy::new()
    ///         .tiers(["user"])
    ///         .limit(LimitPolicy::gcra("trial", Quota::per_second(nz!(1))).per("user").shadow()),
    /// )?;
    /// let alice = TenantKey::single("alice")?;
    /// let first = set.acquire_grant(&alice, 1, Instant::ZERO).unwrap();
    /// assert_eq!(first.shadow_refusals().count(), 0);
    /// let second = set.acquire_grant(&alice, 1, Instant::ZERO).unwrap();
    /// assert_eq!(second.shadow_refusals().collect::<Vec<_>>(), [("trial", Some("user"))]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shadow_refusals(&self) -> impl Iterator<Item = (&'static str, Option<&'static str>)> + '_ {
        let shadowed = self.shadowed;
        self.shape.into_iter().filter(move |_| shadowed != 0).flat_map(move |s| {
            s.limits
                .iter()
                .enumerate()
                .filter(move |&(i, _)| shadowed & (1 << i) != 0)
                .map(|(_, def)| (def.name, def.tier.map(|t| s.tiers[t])))
        })
    }

    /// Whether limit `i` of the grant's policy was in shadow mode and would have refused
    /// it (so it holds nothing of that limit).
    #[inline]
    pub(super) fn shadowed(&self, i: usize) -> bool {
        self.shadowed & (1 << i) != 0
    }

    /// A grant of one cost, as the engine answered it.
    #[inline]
    pub(super) fn uniform(cost: u64, g: Granted) -> Self {
        Grant {
            granted_at: g.granted_at,
            version: g.version,
            shape: g.shape,
            acquired: cost,
            charged: cost,
            each: None,
            shadowed: g.shadowed,
            held: g.held,
        }
    }

    /// A grant of `costs`, as the engine answered it.
    pub(super) fn new(costs: Costs, g: Granted) -> Self {
        match costs {
            Costs::Uniform(cost) => Grant::uniform(cost, g),
            Costs::Each(_) => Grant {
                each: Some(Box::new(EachCosts { acquired: costs.clone(), charged: costs })),
                ..Grant::uniform(0, g)
            },
        }
    }

    /// The cost acquired of limit `i`, which counts `counts`: what a semaphore releases.
    #[inline]
    pub(super) fn acquired_of(&self, i: usize, counts: Counts) -> u64 {
        match &self.each {
            None => Costs::uniform_counting(self.acquired, counts),
            Some(each) => each.acquired.counting(i, counts),
        }
    }

    /// What limit `i` (`def`) is charged now: the cost acquired, or the last settle's.
    #[inline]
    pub(super) fn charged_of(&self, i: usize, def: &LimitDef) -> u64 {
        match &self.each {
            None => Costs::uniform_counting(self.charged, def.counts),
            Some(each) => each.charged.of(i, def),
        }
    }

    /// Records that rate limits are charged `actual` now.
    pub(super) fn set_charged(&mut self, actual: Costs) {
        match (&mut self.each, actual) {
            (None, Costs::Uniform(cost)) => self.charged = cost,
            (Some(each), actual) => each.charged = actual,
            (each @ None, actual) => {
                *each = Some(Box::new(EachCosts { acquired: Costs::Uniform(self.acquired), charged: actual }));
            }
        }
    }
}

/// A grant from [`LimitSet::acquire`], borrowing the set and the key.
///
/// Dropping it releases the concurrency it holds (rate limits hold nothing).
#[must_use = "dropping a permit releases its concurrency at once"]
pub struct Permit<'a> {
    pub(super) set: &'a LimitSet,
    pub(super) key: &'a TenantKey,
    pub(super) grant: Grant,
}

/// A grant from [`LimitSet::acquire_owned`]: like [`Permit`], but `'static`.
#[must_use = "dropping a permit releases its concurrency at once"]
pub struct OwnedPermit {
    pub(super) set: LimitSet,
    pub(super) key: TenantKey,
    pub(super) grant: Grant,
}

macro_rules! permit_methods {
    () => {
        /// The instant the grant was made at (after raising `now` to the latest instant
        /// the set had seen).
        #[must_use]
        pub fn granted_at(&self) -> Instant {
            self.grant.granted_at
        }

        /// The key the grant was made for.
        #[must_use]
        pub fn key(&self) -> &TenantKey {
            &self.key
        }

        /// Corrects limits that count cost to the real usage `actual`: the difference
        /// with the cost acquired (or last settled) is refunded, or charged when the real
        /// usage is higher (recorded, never refused: the work is done; later requests
        /// wait for it). Limits counting requests and semaphores are unchanged; the
        /// concurrency is still held until the permit is dropped.
        ///
        /// A refund's credit comes back at `now` (raised to the latest instant the set
        /// has seen), never above a limit's burst. A rate limit that came back to full
        /// credit between the grant and the settle may then hold more credit than if the
        /// real usage had been known at the grant (see the guide's *Costs, permits and
        /// settling*).
        pub fn settle(&mut self, actual: u64, now: Instant) {
            self.set.shared.settle(&self.key, &mut self.grant, Costs::Uniform(actual), now);
        }

        /// Like [`settle`](Self::settle), with one actual cost per limit in the order of
        /// the policy (semaphores' entries are ignored).
        pub fn settle_each(&mut self, actual: &[u64], now: Instant) {
            self.set.shared.settle(&self.key, &mut self.grant, Costs::Each(actual.into()), now);
        }

        /// Gives back everything: refunds every rate limit as far as each can (see
        /// [`Algorithm::refund`](crate::algorithm::Algorithm::refund)) and releases the
        /// concurrency. For a request that did not happen.
        pub fn cancel(mut self, now: Instant) {
            self.set.shared.cancel(&self.key, &self.grant, now);
            self.set.shared.release(&self.key, &self.grant);
            // Released: the drop that follows finds no shape and gives nothing back twice.
            self.grant.shape = None;
        }

        /// Keeps what was charged and releases the concurrency now; the same as dropping
        /// the permit, spelled out.
        pub fn release(self) {}
    };
}

impl Permit<'_> {
    permit_methods!();
}

impl OwnedPermit {
    permit_methods!();
}

impl Drop for Permit<'_> {
    #[inline]
    fn drop(&mut self) {
        // A grant with no shape holds nothing (a set of rate limits only): one test, and
        // the release stays out of line.
        if self.grant.shape.is_some() {
            self.set.shared.release(self.key, &self.grant);
        }
    }
}

impl Drop for OwnedPermit {
    #[inline]
    fn drop(&mut self) {
        if self.grant.shape.is_some() {
            self.set.shared.release(&self.key, &self.grant);
        }
    }
}

impl fmt::Debug for Permit<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit").field("key", self.key()).field("granted_at", &self.granted_at()).finish()
    }
}

impl fmt::Debug for OwnedPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedPermit").field("key", self.key()).field("granted_at", &self.granted_at()).finish()
    }
}
