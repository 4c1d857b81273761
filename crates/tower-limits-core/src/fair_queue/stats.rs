//! Counters of a [`FairQueue`](super::FairQueue): the whole queue's and one tenant's.
//!
//! The queue counts as it goes (`Counters`) and builds these snapshots on demand; a
//! tenant's counters live in its record and are dropped with it, once the tenant is
//! idle and its finish tag has been reached.

/// Counters of a [`FairQueue`](super::FairQueue), from [`FairQueue::stats`](super::FairQueue::stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FairQueueStats {
    /// Requests queued now.
    pub queued: usize,
    /// Tenants with requests queued now.
    pub backlogged_tenants: usize,
    /// Tenant records kept now: the backlogged ones and idle ones whose finish tag is
    /// still ahead of virtual time.
    pub tracked_tenants: usize,
    /// Requests queued since the queue was made.
    pub enqueued: u64,
    /// Requests dispatched.
    pub dispatched: u64,
    /// Their total cost (saturating).
    pub dispatched_cost: u64,
    /// Requests cancelled.
    pub cancelled: u64,
    /// Requests refused because their tenant's queue was full.
    pub refused_tenant_full: u64,
    /// Requests refused because the whole queue was full.
    pub refused_global_full: u64,
    /// Idle tenant records forgotten early because too many were kept.
    pub evicted_idle: u64,
}

/// Counters of one tenant, from [`FairQueue::tenant_stats`](super::FairQueue::tenant_stats).
///
/// They count from the moment the queue started tracking the tenant; its record, and
/// these counters with it, are dropped once the tenant is idle and its finish tag has
/// been reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantStats {
    /// The weight given with its latest request.
    pub weight: u32,
    /// Its requests queued now.
    pub queued: usize,
    /// Their total cost (saturating).
    pub queued_cost: u64,
    /// Its requests dispatched.
    pub dispatched: u64,
    /// Their total cost (saturating).
    pub dispatched_cost: u64,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) enqueued: u64,
    pub(super) dispatched: u64,
    pub(super) dispatched_cost: u64,
    pub(super) cancelled: u64,
    pub(super) refused_tenant: u64,
    pub(super) refused_global: u64,
    pub(super) evicted: u64,
}
