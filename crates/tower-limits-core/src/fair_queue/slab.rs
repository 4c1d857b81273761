//! Where queued requests live: one slab shared by all tenants, and the tickets into it.
//!
//! Requests live in one slab shared by all tenants; each tenant's queue is a doubly
//! linked list through it, so a request can leave from anywhere in O(1). The slab never
//! holds more than the global queue limit. Free slots are chained through `next`; a slot
//! in use holds its item. A [`Ticket`] is the request's slot in the slab and its arrival
//! number, which the queue never gives twice, so a ticket of a request already
//! dispatched or cancelled matches nothing, even after its slot is reused.

/// The end of a list, and no position.
pub(super) const NONE: u32 = u32::MAX;

/// Identifies one queued request, to [`cancel`](super::FairQueue::cancel) it or reach its item.
///
/// A ticket stays unique for the life of the queue that issued it: once its request is
/// dispatched or cancelled, the ticket matches nothing, even after its slot is reused.
/// A ticket means nothing to another queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    pub(super) slot: u32,
    pub(super) seq: u64,
    pub(super) band: u8,
}

impl Ticket {
    /// The request's arrival number: tickets of one queue compare by it in arrival order.
    #[must_use]
    pub fn arrival(&self) -> u64 {
        self.seq
    }

    /// The band the request waits in (0, the first band configured, goes first).
    #[must_use]
    pub fn band(&self) -> usize {
        usize::from(self.band)
    }
}

pub(super) struct Node<T> {
    /// `None` when the slot is free.
    pub(super) item: Option<T>,
    pub(super) seq: u64,
    pub(super) cost: u64,
    pub(super) tenant: u32,
    pub(super) prev: u32,
    /// The next request of the tenant, or the next free slot.
    pub(super) next: u32,
}
