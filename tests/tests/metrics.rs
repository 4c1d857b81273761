//! Law 26: what the layers report through the `metrics` facade (feature `metrics`), read
//! back from a debugging recorder installed for the test's thread, on tokio's paused
//! clock: every decision counted once under its result and reason, the time in queue and
//! the lease duration to the paused clock's nanosecond, queue depth and active leases
//! back to zero when everything is done, and only bounded labels. Law numbers are those
//! of `crates/tower-limits/docs/laws.md`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower::{Service, ServiceExt};
use tower_limits::core::fair_queue::FairQueueConfig;
use tower_limits::extract::{CostFromExtension, FromExtension, KeyFn};
use tower_limits::metrics::{
    ACTIVE_LEASES, LEASE_DURATION, POOL_SELECTIONS, QUEUED_REQUESTS, REQUESTS, TIME_IN_QUEUE, UPSTREAM_RESPONSES,
};
use tower_limits::{
    FairQueueLayer, GcraLayer, LimitPolicy, LimitPool, LimitSet, LimitSetLayer, LimitSetPolicy, Quota, Selection,
    TenantKey, UpstreamReport, nz,
};

/// What was recorded so far: the debugging recorder hands out each value once (a
/// snapshot resets counters and gauges to zero and drains histograms), so reads
/// accumulate here. Gauges only move by increments and decrements, so their parts add up.
struct Recorded {
    snapshotter: Snapshotter,
    seen: std::cell::RefCell<Values>,
}

/// Values by metric name and sorted labels.
type Values = BTreeMap<(String, Vec<(String, String)>), DebugValue>;

fn read(m: &Recorded) -> Values {
    let mut seen = m.seen.borrow_mut();
    for (key, _, _, value) in m.snapshotter.snapshot().into_vec() {
        let key = key.key().clone();
        let mut labels: Vec<(String, String)> =
            key.labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
        labels.sort();
        let entry = (key.name().to_owned(), labels);
        match (seen.get_mut(&entry), value) {
            (Some(DebugValue::Counter(n)), DebugValue::Counter(more)) => *n += more,
            (Some(DebugValue::Gauge(g)), DebugValue::Gauge(more)) => *g = (g.into_inner() + more.into_inner()).into(),
            (Some(DebugValue::Histogram(h)), DebugValue::Histogram(more)) => h.extend(more),
            (_, value) => {
                seen.insert(entry, value);
            }
        }
    }
    seen.iter().map(|(k, v)| (k.clone(), clone_value(v))).collect()
}

fn clone_value(v: &DebugValue) -> DebugValue {
    match v {
        DebugValue::Counter(n) => DebugValue::Counter(*n),
        DebugValue::Gauge(g) => DebugValue::Gauge(*g),
        DebugValue::Histogram(h) => DebugValue::Histogram(h.clone()),
    }
}

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    v.sort();
    v
}

fn counter(snapshotter: &Recorded, name: &str, pairs: &[(&str, &str)]) -> u64 {
    match read(snapshotter).get(&(name.to_owned(), labels(pairs))) {
        Some(DebugValue::Counter(n)) => *n,
        None => 0,
        Some(other) => panic!("{name} is not a counter: {other:?}"),
    }
}

fn gauge(snapshotter: &Recorded, name: &str, pairs: &[(&str, &str)]) -> Option<f64> {
    match read(snapshotter).get(&(name.to_owned(), labels(pairs))) {
        Some(DebugValue::Gauge(g)) => Some(g.into_inner()),
        None => None,
        Some(other) => panic!("{name} is not a gauge: {other:?}"),
    }
}

fn histogram(snapshotter: &Recorded, name: &str, pairs: &[(&str, &str)]) -> Vec<f64> {
    match read(snapshotter).get(&(name.to_owned(), labels(pairs))) {
        Some(DebugValue::Histogram(h)) => h.iter().map(|v| v.into_inner()).collect(),
        None => Vec::new(),
        Some(other) => panic!("{name} is not a histogram: {other:?}"),
    }
}

/// Runs `test` on a paused current-thread runtime with a debugging recorder installed
/// for this thread (so tests running in parallel do not see each other's numbers).
fn with_recorder<F: std::future::Future<Output = ()>>(test: impl FnOnce(Recorded) -> F) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = Recorded { snapshotter: recorder.snapshotter(), seen: Default::default() };
    let _local = metrics::set_default_local_recorder(&recorder);
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
    rt.block_on(test(snapshotter));
}

fn tenant_request(tenant: &str, cost: u64) -> http::Request<String> {
    let mut req = http::Request::new(String::new());
    req.extensions_mut().insert(TenantKey::new(["acme", tenant]).unwrap());
    req.extensions_mut().insert(tower_limits::extract::Cost(cost));
    req
}

#[test]
fn decisions_are_counted_by_result_reason_limit_and_tier() {
    with_recorder(|m| async move {
        let layer = LimitSetLayer::new(
            LimitSetPolicy::new()
                .tiers(["org", "user"])
                .limit(LimitPolicy::gcra("requests", Quota::per_hour(nz!(60)).burst(nz!(2))).per("user"))
                .limit(
                    LimitPolicy::token_bucket("tokens", Quota::per_minute(nz!(1_000)).burst(nz!(100)))
                        .per("org")
                        .counting_cost(),
                ),
        )
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .cost(CostFromExtension)
        .metrics_name("api");
        let svc = tower::ServiceBuilder::new().layer(layer).service_fn(|_req: http::Request<String>| async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            Ok::<_, Infallible>(())
        });
        svc.clone().oneshot(tenant_request("alice", 10)).await.unwrap();
        svc.clone().oneshot(tenant_request("alice", 10)).await.unwrap();
        assert!(svc.clone().oneshot(tenant_request("alice", 10)).await.is_err());
        assert!(svc.clone().oneshot(tenant_request("bob", 1_000)).await.is_err());
        assert!(svc.clone().oneshot(http::Request::new(String::new())).await.is_err());

        let refused = |reason: &str, limit: &str, tier: &str| {
            counter(
                &m,
                REQUESTS,
                &[("layer", "api"), ("result", "refused"), ("reason", reason), ("limit", limit), ("tier", tier)],
            )
        };
        assert_eq!(counter(&m, REQUESTS, &[("layer", "api"), ("result", "admitted")]), 2);
        assert_eq!(refused("rate_limited", "requests", "user"), 1);
        assert_eq!(refused("cost_above_capacity", "tokens", "org"), 1);
        assert_eq!(refused("missing_key", "", ""), 1);
        // Each lease lasted as long as the inner service: 1.5 s on the paused clock.
        assert_eq!(histogram(&m, LEASE_DURATION, &[("layer", "api")]), [1.5, 1.5]);
        assert_eq!(gauge(&m, ACTIVE_LEASES, &[("layer", "api")]), Some(0.0));
    });
}

#[test]
fn waits_report_their_time_in_queue_and_cancellations() {
    with_recorder(|m| async move {
        let layer = GcraLayer::new(Quota::per_second(nz!(1))).wait(Duration::from_secs(5)).metrics_name("client");
        let svc = tower::ServiceBuilder::new().layer(layer).service_fn(|r: u32| async move { Ok::<_, Infallible>(r) });
        svc.clone().oneshot(0).await.unwrap();
        // Waits one second for the rate.
        svc.clone().oneshot(1).await.unwrap();
        // Queued, then dropped by its caller: a cancellation.
        let mut waiting = Box::pin(svc.clone().oneshot(2));
        assert!(futures_poll(&mut waiting).is_none());
        assert_eq!(gauge(&m, QUEUED_REQUESTS, &[("layer", "client")]), Some(1.0));
        tokio::time::advance(Duration::from_millis(250)).await;
        drop(waiting);

        assert_eq!(histogram(&m, TIME_IN_QUEUE, &[("layer", "client"), ("result", "admitted")]), [1.0]);
        assert_eq!(histogram(&m, TIME_IN_QUEUE, &[("layer", "client"), ("result", "cancelled")]), [0.25]);
        assert_eq!(counter(&m, REQUESTS, &[("layer", "client"), ("result", "cancelled")]), 1);
        assert_eq!(counter(&m, REQUESTS, &[("layer", "client"), ("result", "admitted")]), 2);
        assert_eq!(gauge(&m, QUEUED_REQUESTS, &[("layer", "client")]), Some(0.0));
    });
}

/// Polls once with a no-op waker: `Some` if ready.
fn futures_poll<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::Pin::new(f).poll(&mut cx) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}

#[test]
fn shadow_refusals_are_reported_as_such() {
    with_recorder(|m| async move {
        let layer = GcraLayer::new(Quota::per_minute(nz!(1))).shadow().metrics_name("shadow");
        let svc = tower::ServiceBuilder::new().layer(layer).service_fn(|r: u32| async move { Ok::<_, Infallible>(r) });
        for i in 0..3 {
            svc.clone().oneshot(i).await.unwrap();
        }
        let set = LimitSetLayer::new(
            LimitSetPolicy::new()
                .limit(LimitPolicy::gcra("enforced", Quota::per_minute(nz!(100))))
                .limit(LimitPolicy::gcra("trial", Quota::per_minute(nz!(1))).shadow()),
        )
        .unwrap()
        .metrics_name("trial");
        let svc = tower::ServiceBuilder::new().layer(set).service_fn(|r: u32| async move { Ok::<_, Infallible>(r) });
        for i in 0..3 {
            svc.clone().oneshot(i).await.unwrap();
        }

        let shadowed = [
            ("layer", "shadow"),
            ("result", "shadow_refused"),
            ("reason", "rate_limited"),
            ("limit", "gcra"),
            ("tier", ""),
        ];
        assert_eq!(counter(&m, REQUESTS, &shadowed), 2);
        assert_eq!(counter(&m, REQUESTS, &[("layer", "shadow"), ("result", "admitted")]), 1);
        let trial = [
            ("layer", "trial"),
            ("result", "shadow_refused"),
            ("reason", "shadow_limit"),
            ("limit", "trial"),
            ("tier", ""),
        ];
        assert_eq!(counter(&m, REQUESTS, &trial), 2);
        assert_eq!(counter(&m, REQUESTS, &[("layer", "trial"), ("result", "admitted")]), 1);
        // The shadow-limit grants held leases (the enforcing limit was charged).
        assert_eq!(histogram(&m, LEASE_DURATION, &[("layer", "trial")]).len(), 3);
    });
}

#[test]
fn the_fair_queue_reports_depth_per_configured_tenant_only() {
    with_recorder(|m| async move {
        let fair = FairQueueLayer::concurrency(FairQueueConfig::new().tenant_queue_limit(2), 1)
            .unwrap()
            .key(KeyFn::new(|t: &&'static str| TenantKey::single(t).ok()))
            .metrics_name("upstream")
            .metrics_tenants(["acme"])
            .unwrap();
        let (svc, mut handle) = tower_test::mock::pair::<&'static str, ()>();
        let mut svc = tower::Layer::layer(&fair, svc);
        handle.allow(100);
        let mut calls = Vec::new();
        for tenant in ["acme", "acme", "acme", "globex", "acme"] {
            calls.push(tokio::spawn(svc.ready().await.unwrap().call(tenant)));
        }
        tokio::task::yield_now().await;
        let (_, first) = handle.next_request().await.unwrap();
        // acme: one in flight, two queued, the fourth refused; globex: one queued.
        assert_eq!(gauge(&m, QUEUED_REQUESTS, &[("layer", "upstream")]), Some(3.0));
        assert_eq!(gauge(&m, QUEUED_REQUESTS, &[("layer", "upstream"), ("tenant", "acme")]), Some(2.0));
        let names: Vec<_> = read(&m).into_keys().filter(|(n, _)| n == QUEUED_REQUESTS).collect();
        assert!(names.iter().all(|(_, l)| l.iter().all(|(k, v)| k != "tenant" || v == "acme")), "{names:?}");
        tokio::time::advance(Duration::from_millis(400)).await;
        first.send_response(());
        for _ in 0..3 {
            let (_, next) = handle.next_request().await.unwrap();
            next.send_response(());
        }
        let mut refused = 0;
        for call in calls {
            if call.await.unwrap().is_err() {
                refused += 1;
            }
        }
        assert_eq!(refused, 1);
        let reason = [
            ("layer", "upstream"),
            ("result", "refused"),
            ("reason", "tenant_queue_full"),
            ("limit", ""),
            ("tier", ""),
        ];
        assert_eq!(counter(&m, REQUESTS, &reason), 1);
        assert_eq!(counter(&m, REQUESTS, &[("layer", "upstream"), ("result", "admitted")]), 4);
        assert_eq!(gauge(&m, QUEUED_REQUESTS, &[("layer", "upstream")]), Some(0.0));
        assert_eq!(gauge(&m, QUEUED_REQUESTS, &[("layer", "upstream"), ("tenant", "acme")]), Some(0.0));
        let waits = histogram(&m, TIME_IN_QUEUE, &[("layer", "upstream"), ("result", "admitted")]);
        assert_eq!(waits.len(), 3);
        assert!(waits.iter().all(|w| (*w - 0.4).abs() < 1e-9), "{waits:?}");
    });
}

#[test]
fn a_pool_counts_its_choices_and_what_upstreams_said() {
    with_recorder(|m| async move {
        let account = || {
            LimitSet::new(
                LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", Quota::per_minute(nz!(60)).burst(nz!(1)))),
            )
            .unwrap()
        };
        let pool = LimitPool::builder(Selection::RoundRobin)
            .member("east", account(), ())
            .member("west", account(), ())
            .build()
            .unwrap();
        let global = TenantKey::global();
        let now = tower_limits::Instant::ZERO;
        let a = pool.acquire(&global, 1, now).unwrap();
        let b = pool.acquire(&global, 1, now).unwrap();
        pool.observe(
            a.chosen().index,
            &UpstreamReport { retry_after: Some(Duration::from_secs(1)), ..UpstreamReport::default() },
            now,
        );
        pool.observe(b.chosen().index, &UpstreamReport::default(), now);
        assert_eq!(counter(&m, POOL_SELECTIONS, &[("member", "east")]), 1);
        assert_eq!(counter(&m, POOL_SELECTIONS, &[("member", "west")]), 1);
        let upstream =
            |member: &str, result: &str| counter(&m, UPSTREAM_RESPONSES, &[("member", member), ("result", result)]);
        assert_eq!(upstream(&a.chosen().name, "rate_limited"), 1);
        assert_eq!(upstream(&b.chosen().name, "ok"), 1);
    });
}
