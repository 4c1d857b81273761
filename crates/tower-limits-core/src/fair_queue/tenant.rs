//! A tenant's record: its key, weight, tags, the ends of its queue and its counters.
//!
//! It owns the tag arithmetic of the module docs' "Exact integer tags": tags count units
//! of 2⁻³² of a cost unit per unit of weight, in `u128`; each tenant keeps its tag
//! exactly, as whole units plus a remainder over its weight (`rem < weight`), and carries
//! the remainder into its next division. A tenant whose weight changes while it carries
//! a remainder has it rounded up to the new weight, which delays it by less than 2⁻³².
//! Tags saturate rather than overflow.

use super::slab::NONE;

/// Tags count virtual time in units of 2^-FRACTION_BITS of one cost unit per weight.
pub(super) const FRACTION_BITS: u32 = 32;

pub(super) struct Tenant<K> {
    pub(super) key: K,
    pub(super) hash: u64,
    /// Backlogged: the start tag of the head, in whole units. Idle: the finish tag.
    pub(super) tag: u128,
    /// The exact tag is `tag + rem / weight` units; `rem < weight`.
    pub(super) rem: u32,
    pub(super) weight: u32,
    pub(super) head: u32,
    pub(super) tail: u32,
    pub(super) len: u32,
    pub(super) queued_cost: u64,
    pub(super) dispatched: u64,
    pub(super) dispatched_cost: u64,
}

impl<K> Tenant<K> {
    /// A tenant with nothing queued or dispatched yet, its tag at `tag`.
    pub(super) fn new(key: K, hash: u64, tag: u128, weight: u32) -> Self {
        Tenant {
            key,
            hash,
            tag,
            rem: 0,
            weight,
            head: NONE,
            tail: NONE,
            len: 0,
            queued_cost: 0,
            dispatched: 0,
            dispatched_cost: 0,
        }
    }

    /// The finish tag after serving `cost` from the current start tag, carrying the
    /// remainder. `cost * 2^32 / weight` is computed in two 64-bit divisions.
    pub(super) fn advance(&mut self, cost: u64) {
        let w = u64::from(self.weight);
        let (whole, part) = (cost / w, cost % w);
        // part < w < 2^32 and rem < w, so this fits in 64 bits.
        let low = (part << FRACTION_BITS) | u64::from(self.rem);
        let step = (u128::from(whole) << FRACTION_BITS) + u128::from(low / w);
        self.tag = self.tag.saturating_add(step);
        self.rem = (low % w) as u32;
    }

    /// Takes `weight` for what is served from now on; returns whether `tag` moved.
    pub(super) fn reweight(&mut self, weight: u32) -> bool {
        if self.weight == weight {
            return false;
        }
        let old = self.weight;
        self.weight = weight;
        if self.rem == 0 {
            return false;
        }
        // rem/old rounded up to a multiple of 1/weight: at most one unit, and only later.
        let rem = (u64::from(self.rem) * u64::from(weight)).div_ceil(u64::from(old));
        if rem >= u64::from(weight) {
            self.rem = 0;
            self.tag = self.tag.saturating_add(1);
            true
        } else {
            self.rem = rem as u32;
            false
        }
    }

    /// The exact tag rounded up to a whole unit.
    pub(super) fn ceil_tag(&self) -> u128 {
        self.tag.saturating_add(u128::from(self.rem != 0))
    }
}

pub(super) fn tenant<K>(tenants: &[Option<Tenant<K>>], slot: u32) -> &Tenant<K> {
    match &tenants[slot as usize] {
        Some(t) => t,
        None => unreachable!("a tenant slot in use holds a tenant"),
    }
}

pub(super) fn tenant_mut<K>(tenants: &mut [Option<Tenant<K>>], slot: u32) -> &mut Tenant<K> {
    match &mut tenants[slot as usize] {
        Some(t) => t,
        None => unreachable!("a tenant slot in use holds a tenant"),
    }
}
