//! The heaps of tenants: backlogged ones by their head's start tag, idle ones by their
//! finish tag.
//!
//! Each backlogged tenant has one entry in a binary heap keyed by its head's (start tag,
//! arrival number); the entry knows its tenant and the tenant knows its entry's
//! position, so the entry is moved in place when the head changes. Dispatch, and every
//! change of a head, costs O(log n) in the number of backlogged tenants; nothing ever
//! scans the tenants. Every move of an entry records its new position in `positions`.

#[derive(Clone, Copy)]
pub(super) struct Entry {
    pub(super) tag: u128,
    pub(super) seq: u64,
    pub(super) tenant: u32,
}

impl Entry {
    #[inline]
    pub(super) fn before(&self, other: &Entry) -> bool {
        (self.tag, self.seq) < (other.tag, other.seq)
    }
}

/// A binary min-heap of tenants that records each tenant's position.
#[derive(Default)]
pub(super) struct Heap {
    pub(super) entries: Vec<Entry>,
}

impl Heap {
    pub(super) fn push(&mut self, entry: Entry, positions: &mut [u32]) {
        self.entries.push(entry);
        self.sift_up(self.entries.len() - 1, positions);
    }

    pub(super) fn remove(&mut self, at: usize, positions: &mut [u32]) -> Entry {
        let removed = self.entries.swap_remove(at);
        if at < self.entries.len() && self.sift_up(at, positions) == at {
            self.sift_down(at, positions);
        }
        removed
    }

    /// Replaces the entry at `at` with one that sorts no earlier.
    pub(super) fn replace_later(&mut self, at: usize, entry: Entry, positions: &mut [u32]) {
        self.entries[at] = entry;
        self.sift_down(at, positions);
    }

    fn sift_up(&mut self, mut at: usize, positions: &mut [u32]) -> usize {
        let entry = self.entries[at];
        while at > 0 {
            let parent = (at - 1) / 2;
            let p = self.entries[parent];
            if !entry.before(&p) {
                break;
            }
            self.entries[at] = p;
            positions[p.tenant as usize] = at as u32;
            at = parent;
        }
        self.entries[at] = entry;
        positions[entry.tenant as usize] = at as u32;
        at
    }

    fn sift_down(&mut self, mut at: usize, positions: &mut [u32]) {
        let entry = self.entries[at];
        let len = self.entries.len();
        loop {
            let left = 2 * at + 1;
            if left >= len {
                break;
            }
            let right = left + 1;
            let child = if right < len && self.entries[right].before(&self.entries[left]) { right } else { left };
            let c = self.entries[child];
            if !c.before(&entry) {
                break;
            }
            self.entries[at] = c;
            positions[c.tenant as usize] = at as u32;
            at = child;
        }
        self.entries[at] = entry;
        positions[entry.tenant as usize] = at as u32;
    }
}
