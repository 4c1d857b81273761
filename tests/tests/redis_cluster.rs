//! Laws 21 and 29 on Redis Cluster: three masters on loopback ports. A set's keys for
//! one tenant share a slot, tenants spread over the nodes, and a set that would need two
//! slots is refused when it is built instead of failing with `CROSSSLOT` at run time;
//! capacity shares refresh one slot per call. Law numbers are those of
//! `crates/tower-limits/docs/laws.md`.

mod redis_common;

use std::collections::BTreeSet;
use std::time::Duration;

use tower_limits_core::{AcquireError, Backend, Instant, LimitPolicy, LimitSetPolicy, Quota, TenantKey, nz};
use tower_limits_redis::test_support::cluster_for;
use tower_limits_redis::{BuildError, RedisBackend, RedisConnection, SlotLayout, key_slot};

use redis_common::{namespace, runtime};

fn keyed() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(10)).burst(nz!(3))).per("user"))
        .limit(LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(100))).per("org").counting_cost())
        .limit(LimitPolicy::semaphore("concurrent", 2).per("org"))
        .limit(LimitPolicy::sliding_window_log("log", 50, Duration::from_secs(60)).per("user"))
}

#[test]
fn cluster_slots() {
    let Some(cluster) = cluster_for("cluster_slots", 3) else { return };
    let node = &cluster.nodes()[0];
    runtime().block_on(async {
        let conn = RedisConnection::connect_cluster(cluster.urls()).await.expect("a cluster connection");
        assert!(conn.is_cluster());

        // Global and keyed limits in one set would need two slots: refused at build time.
        let mixed = keyed().limit(LimitPolicy::gcra("everyone", Quota::per_second(nz!(1000))));
        let err = RedisBackend::builder(mixed.clone()).namespace(namespace("c")).build(&conn).unwrap_err();
        assert!(matches!(&err, BuildError::CrossSlot { global, keyed } if global == "everyone" && keyed == "requests"));
        assert!(err.to_string().contains("OneSlot"), "{err}");

        // One slot for the whole set: atomic, on one node.
        let one = RedisBackend::builder(mixed)
            .namespace(namespace("c"))
            .slot_layout(SlotLayout::OneSlot("shared".into()))
            .build(&conn)
            .unwrap();
        let alice = TenantKey::new(["acme", "alice"]).unwrap();
        let slots: BTreeSet<u16> = one.keys(&alice).iter().map(|k| key_slot(k)).collect();
        assert_eq!(slots.len(), 1);
        let g = one.acquire(&alice, 10, Instant::ZERO).await.unwrap();
        one.release(&alice, g);
        one.flush().await;

        // Per tenant: each tenant's keys in one slot (as the server computes it), tenants
        // spread over the three nodes, every acquisition one script.
        let backend = RedisBackend::builder(keyed()).namespace(namespace("c")).build(&conn).unwrap();
        let mut nodes_used = BTreeSet::new();
        for t in 0..30 {
            let key = TenantKey::new([format!("org-{t}"), "user".to_owned()]).unwrap();
            let keys = backend.keys(&key);
            let slot = key_slot(&keys[0]);
            for k in &keys {
                let server_slot: u16 = node.command(&["CLUSTER", "KEYSLOT", k]).unwrap().parse().unwrap();
                assert_eq!(server_slot, slot, "{k}");
            }
            nodes_used.insert((usize::from(slot) / (16384 / 3)).min(2));
            let mut grants = Vec::new();
            for _ in 0..3 {
                match backend.acquire(&key, 1, Instant::ZERO).await {
                    Ok(g) => grants.push(g),
                    Err(AcquireError::Refused(d)) => assert!(d.needs_release(), "{d:?}"),
                    Err(e) => panic!("{e}"),
                }
            }
            assert_eq!(grants.len(), 2, "the semaphore holds two");
            for g in grants {
                backend.release(&key, g);
            }
        }
        backend.flush().await;
        assert_eq!(nodes_used.len(), 3, "tenants spread over every node");
        let stats = backend.stats();
        assert_eq!((stats.errors, stats.timeouts), (0, 0), "{stats:?}");
        assert_eq!(stats.script_loads, 3, "the script is loaded once per node: {stats:?}");
    });
}

/// Law 29 on a cluster: capacity shares of tenants spread over the three masters, each
/// refresh one call per slot, every grant within its tenant's limits (a rate, a
/// semaphore, and a window leased in blocks).
#[test]
fn cluster_shares() {
    let Some(cluster) = cluster_for("cluster_shares", 3) else { return };
    runtime().block_on(async {
        let conn = RedisConnection::connect_cluster(cluster.urls()).await.expect("a cluster connection");
        let policy = LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(100)).burst(nz!(5))).per("user"))
            .limit(LimitPolicy::semaphore("concurrent", 2).per("org"))
            .limit(LimitPolicy::fixed_window("window", 40, Duration::from_secs(1)).per("org"));
        let ns = namespace("c-shares");
        let shares = tower_limits_redis::Shares::new()
            .refresh_every(Duration::from_millis(20))
            .lifetime(Duration::from_millis(100))
            .hot_after(1)
            // A burst of 5 split on purpose.
            .min_burst(1);
        let replicas: Vec<RedisBackend> = (0..2)
            .map(|_| {
                RedisBackend::builder(policy.clone())
                    .namespace(&ns)
                    .manual_clock()
                    .timeout(Duration::from_secs(5))
                    .shares(shares)
                    .build(&conn)
                    .unwrap()
            })
            .collect();
        let tenants: Vec<TenantKey> =
            (0..12).map(|t| TenantKey::new([format!("org-{t}"), "user".to_owned()]).unwrap()).collect();
        let slots: BTreeSet<u16> = tenants.iter().map(|k| key_slot(&replicas[0].keys(k)[0])).collect();
        assert!(slots.len() > 3, "tenants spread over slots: {slots:?}");
        let start = 1_000_000_000_000u64;
        let mut admitted = vec![0u64; tenants.len()];
        for ms in 0..400u64 {
            let now = Instant::from_nanos(start + ms * 1_000_000);
            if ms % 20 == 0 {
                for r in &replicas {
                    assert!(r.refresh_shares(now).await, "a refresh on the cluster at {ms} ms");
                }
            }
            for (t, key) in tenants.iter().enumerate() {
                let r = &replicas[(ms as usize + t) % 2];
                match r.acquire(key, 1, now).await {
                    Ok(grant) => {
                        admitted[t] += 1;
                        r.release(key, grant);
                    }
                    Err(AcquireError::Refused(_)) => {}
                    Err(e) => panic!("{e}"),
                }
            }
        }
        for (t, n) in admitted.iter().enumerate() {
            // At most the window's 40 (the rate allows the burst plus 0.4 s at 100/s, 45);
            // and most of it used.
            assert!((20..=40).contains(n), "tenant {t}: {n} admitted");
        }
        let stats = replicas[0].stats();
        assert!(stats.shared_grants > stats.granted, "{stats:?}");
        // One refresh call per slot with a busy tenant, 20 refreshes.
        assert!(stats.share_refreshes >= 20 * slots.len() as u64 / 2, "{stats:?}");
    });
}
