//! Bytes per tracked key: our keyed GCRA set against governor's default keyed store, in
//! the same run, for text ids, IPv4 addresses and numeric ids, counted by a global
//! allocator (live bytes requested, so allocator overhead is left out for both).
//!
//! Run: `cargo bench -p tower-limits-benches --bench memory`.
#![allow(unsafe_code, clippy::print_stdout)] // a counting allocator; printing is the point

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicIsize, Ordering};

use governor::{Quota, RateLimiter};
use tower_limits_core::{Instant, LimitPolicy, LimitSet, LimitSetPolicy, TenantKey, nz};

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

/// Live bytes per key after `insert` has tracked `KEYS` keys.
fn per_key(insert: impl FnOnce()) -> f64 {
    let before = live();
    insert();
    (live() - before) as f64 / KEYS as f64
}

/// One row: `ours` tracked by our keyed GCRA set, `theirs` (the same keys in their
/// natural type) by governor's keyed store.
fn row<K: std::hash::Hash + Eq + Clone>(name: &str, ours: &[TenantKey], theirs: &[K]) {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .max_keys(2 * KEYS)
            .limit(LimitPolicy::gcra("r", tower_limits_core::Quota::per_second(nz!(1_000))).per("tenant")),
    )
    .expect("policy");
    let o = per_key(|| {
        for k in ours {
            black_box(set.acquire(k, 1, Instant::ZERO).is_ok());
        }
    });
    assert_eq!(set.tracked_keys(), KEYS);
    let gov = RateLimiter::keyed(Quota::per_second(NonZeroU32::new(1_000).expect("non-zero")));
    let t = per_key(|| {
        for k in theirs {
            black_box(gov.check_key(k).is_ok());
        }
    });
    assert_eq!(gov.len(), KEYS);
    println!("  {name:<34} {o:>7.1} {t:>9.1} {:>7.2}", o / t);
}

fn main() {
    println!("bytes per tracked key ({KEYS} keys, live bytes requested):");
    println!("  {:<34} {:>7} {:>9} {:>7}", "keys", "ours", "governor", "ratio");

    // Text ids: ours keeps the path, governor its `String` key.
    let names: Vec<String> = (0..KEYS).map(|i| format!("tenant-{i:06}")).collect();
    let keys: Vec<TenantKey> = names.iter().map(|s| TenantKey::single(s).expect("key")).collect();
    row("\"tenant-NNNNNN\" (String)", &keys, &names);

    // Client addresses: both key by the address's bytes (ours in the entry's path words).
    let ips: Vec<IpAddr> =
        (0..KEYS as u32).map(|n| IpAddr::from([10, (n >> 16) as u8, (n >> 8) as u8, n as u8])).collect();
    let keys: Vec<TenantKey> = ips.iter().map(|ip| TenantKey::from_ip(*ip)).collect();
    row("IPv4 addresses (IpAddr)", &keys, &ips);

    // Numeric ids: both key by the number (ours in its table of numbers).
    let ids: Vec<u64> = (0..KEYS as u64).map(|i| 1_000_000_007 * i).collect();
    let keys: Vec<TenantKey> = ids.iter().copied().map(TenantKey::from_u64).collect();
    row("numeric ids (u64)", &keys, &ids);
}
