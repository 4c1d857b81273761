//! Bytes per tracked key: our keyed GCRA set against governor's default keyed store, in
//! the same run, counted by a global allocator (live bytes requested, so allocator
//! overhead is left out for both).
//!
//! Run: `cargo bench -p tower-limits-benches --bench memory`.
#![allow(unsafe_code, clippy::print_stdout)] // a counting allocator; printing is the point

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicIsize, Ordering};

use governor::{Quota, RateLimiter};
use tower_limits_core::{Instant, LimitPolicy, LimitSet, LimitSetPolicy, Rate, TenantKey};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call forwards to the system allocator unchanged; the counter only
// observes sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `dealloc` is passed on as is.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `realloc` is passed on as is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

const KEYS: usize = 100_000;

fn main() {
    let names: Vec<String> = (0..KEYS).map(|i| format!("tenant-{i:06}")).collect();
    let keys: Vec<TenantKey> = names.iter().map(|s| TenantKey::single(s).expect("key")).collect();

    let before = live();
    let ours = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .max_keys(2 * KEYS)
            .limit(LimitPolicy::gcra("r", Rate::per_second(1_000), 1_000).per("tenant")),
    )
    .expect("policy");
    for k in &keys {
        black_box(ours.acquire(k, 1, Instant::ZERO).is_ok());
    }
    let ours_bytes = live() - before;
    assert_eq!(ours.tracked_keys(), KEYS);

    let before = live();
    let theirs = RateLimiter::keyed(Quota::per_second(NonZeroU32::new(1_000).expect("non-zero")));
    for n in &names {
        black_box(theirs.check_key(n).is_ok());
    }
    let theirs_bytes = live() - before;
    assert_eq!(theirs.len(), KEYS);

    let per = |b: isize| b as f64 / KEYS as f64;
    println!("bytes per tracked key ({KEYS} keys \"tenant-NNNNNN\", live bytes requested):");
    println!("  tower-limits keyed GCRA : {:>7.1}", per(ours_bytes));
    println!("  governor keyed (dashmap): {:>7.1}", per(theirs_bytes));
    println!("  ratio                   : {:>7.2}", ours_bytes as f64 / theirs_bytes as f64);
}
