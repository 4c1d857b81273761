//! Law 25: `LimitPool` through the layer: the chosen account reaches the inner service,
//! exhausted accounts make requests wait for the first to free, and upstream refusals
//! bench an account. Then the pool's own laws: its members by place and name, each
//! selection's order, the refusal it reports when every member refuses or is benched,
//! what a grant holds, and a pool whose accounts live in a shared store (a fake one here;
//! the Redis store has its own tests). Law numbers are those of
//! `crates/tower-limits/docs/laws.md`.

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::{ServiceBuilder, ServiceExt};
use tower_limits::extract::InsertChosen;
use tower_limits::http::{HttpAnswer, upstream_report};
use tower_limits::{Chosen, LimitPolicy, LimitPool, LimitSet, LimitSetLayer, LimitSetPolicy, Quota, Selection, nz};
use tower_limits_tests::quota;

const MINUTE: Duration = Duration::from_secs(60);

fn account(rpm: u64) -> LimitSet {
    LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", quota(rpm, MINUTE, 1)))).unwrap()
}

fn pool() -> LimitPool<&'static str> {
    LimitPool::builder(Selection::RoundRobin)
        .member("primary", account(60), "sk-primary")
        .member("secondary", account(30), "sk-secondary")
        .build()
        .unwrap()
}

fn upstream() -> impl tower::Service<Request<String>, Response = Response<String>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    tower::service_fn(|req: Request<String>| async move {
        let chosen = req.extensions().get::<Chosen<&'static str>>().expect("the pool says which account");
        Ok::<_, Infallible>(Response::new(chosen.config.to_string()))
    })
}

#[tokio::test(start_paused = true)]
async fn the_chosen_account_reaches_the_inner_service() {
    let layer = LimitSetLayer::with_backend(pool()).annotate(InsertChosen).refuse_with(HttpAnswer::new());
    let svc = ServiceBuilder::new().layer(layer).service(upstream());
    let a = svc.clone().oneshot(Request::new(String::new())).await.unwrap();
    let b = svc.clone().oneshot(Request::new(String::new())).await.unwrap();
    let mut bodies = vec![a.into_body().into_inner(), b.into_body().into_inner()];
    bodies.sort();
    assert_eq!(bodies, ["sk-primary", "sk-secondary"]);
    let refused = svc.oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(
        refused.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "every account is out: a rate limit, paced by Retry-After"
    );
    assert_eq!(refused.headers()["retry-after"], "1", "the primary frees first, in one second");
}

#[tokio::test(start_paused = true)]
async fn waiting_requests_take_the_first_account_to_free() {
    let layer = LimitSetLayer::with_backend(pool())
        .annotate(InsertChosen)
        .wait(Duration::from_secs(5))
        .refuse_with(HttpAnswer::new());
    let svc = ServiceBuilder::new().layer(layer).service(upstream());
    let start = tokio::time::Instant::now();
    for _ in 0..2 {
        svc.clone().oneshot(Request::new(String::new())).await.unwrap();
    }
    let third = svc.clone().oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(third.into_body().into_inner(), "sk-primary");
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    let fourth = svc.oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(fourth.into_body().into_inner(), "sk-secondary", "the secondary frees at 2s, before the primary again");
    assert_eq!(start.elapsed(), Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn an_upstream_refusal_benches_the_account() {
    let pool = pool();
    let layer = LimitSetLayer::with_backend(pool.clone()).annotate(InsertChosen).refuse_with(HttpAnswer::new());
    let now = layer.now();
    let svc = ServiceBuilder::new().layer(layer).service(upstream());
    // The primary's upstream answers 429 with Retry-After: 30.
    let mut headers = http::HeaderMap::new();
    headers.insert("retry-after", http::HeaderValue::from_static("30"));
    let report = upstream_report(StatusCode::TOO_MANY_REQUESTS, &headers);
    pool.observe(pool.index_of("primary").unwrap(), &report, now);
    let first = svc.clone().oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(first.into_body().into_inner(), "sk-secondary");
    let refused = svc.oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "2", "the secondary frees before the primary's bench ends");
}

// ---- The pool's own laws, on the core's API and a manual clock. ----

use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use tower_limits_core::{
    AcquireError, Backend, Instant, LimitSnapshot, PoolGrant, SharedAccounts, SharedAcquire, SharedGrant, TenantKey,
    Unavailable, UpstreamReport,
};

const SECOND: u64 = 1_000_000_000;

/// An account with room for a thousand requests at once.
fn roomy() -> LimitSet {
    LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("rps", Quota::per_second(nz!(1_000))))).unwrap()
}

/// An account of `per_minute` requests with a burst of `burst`.
fn rate(per_minute: u64, burst: u64) -> LimitSet {
    LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", quota(per_minute, MINUTE, burst)))).unwrap()
}

/// An account of `per_minute` units (a request's cost) with a burst of `burst` units.
fn units(per_minute: u64, burst: u64) -> LimitSet {
    LimitSet::new(
        LimitSetPolicy::new().limit(LimitPolicy::gcra("upm", quota(per_minute, MINUTE, burst)).counting_cost()),
    )
    .unwrap()
}

/// An account of one request at a time (and a roomy rate).
fn one_at_a_time() -> LimitSet {
    LimitSet::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("rps", Quota::per_second(nz!(1_000))))
            .limit(LimitPolicy::semaphore("concurrent", 1)),
    )
    .unwrap()
}

fn members(selection: Selection, sets: Vec<LimitSet>) -> LimitPool {
    let names = ["a", "b", "c", "d"];
    sets.into_iter()
        .zip(names)
        .fold(LimitPool::builder(selection), |b, (set, name)| b.member(name, set, ()))
        .build()
        .unwrap()
}

/// The member a pool grants `cost` from at `now`; the grant is given back at once
/// (nothing for a rate: what it charged stays charged).
fn pick(pool: &LimitPool, cost: u64, now: Instant) -> usize {
    let key = TenantKey::global();
    let grant = pool.acquire(&key, cost, now).expect("granted");
    let index = grant.chosen().index;
    pool.release(&key, grant);
    index
}

fn refusal(result: Result<PoolGrant<()>, AcquireError>) -> tower_limits_core::LimitRefusal {
    match result {
        Err(AcquireError::Refused(d)) => d,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn bench(pool: &LimitPool, index: usize, secs: u64, now: Instant) {
    pool.observe(index, &UpstreamReport { retry_after: Some(Duration::from_secs(secs)), ..Default::default() }, now);
}

#[test]
fn a_pool_knows_its_members_by_place_and_name() {
    let pool = members(Selection::RoundRobin, vec![roomy(), roomy(), roomy()]);
    assert_eq!(pool.len(), 3);
    assert!(!pool.is_empty());
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        assert_eq!(pool.index_of(name), Some(i));
        assert!(pool.member_set(i).is_some());
    }
    assert_eq!(pool.index_of("d"), None);
    assert!(pool.member_set(3).is_none());
    let shown = format!("{pool:?}");
    assert!(shown.contains(r#"["a", "b", "c"]"#) && shown.contains("RoundRobin"), "{shown}");

    let empty = LimitPool::<()>::builder(Selection::RoundRobin).build().unwrap_err();
    assert_eq!(empty.field(), "members");
    let twice = LimitPool::builder(Selection::RoundRobin)
        .member("a", roomy(), ())
        .member("b", roomy(), ())
        .member("a", roomy(), ())
        .build()
        .unwrap_err();
    assert_eq!(twice.field(), "members[2]");
    assert!(twice.message().contains(r#""a""#), "{}", twice.message());
}

#[test]
fn round_robin_starts_each_request_at_the_next_member() {
    let pool = members(Selection::RoundRobin, vec![roomy(), roomy(), roomy()]);
    let picks: Vec<usize> = (0..7).map(|_| pick(&pool, 1, Instant::ZERO)).collect();
    assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0]);
    // A member that refuses passes the request to the next in turn.
    let pool = members(Selection::RoundRobin, vec![roomy(), rate(60, 1), roomy()]);
    let picks: Vec<usize> = (0..6).map(|_| pick(&pool, 1, Instant::ZERO)).collect();
    assert_eq!(picks, [0, 1, 2, 0, 2, 2], "b's one request is spent; its turns go to c");
}

#[test]
fn random_selection_spreads_requests_over_every_member() {
    let pool = members(Selection::Random, vec![roomy(), roomy(), roomy(), roomy()]);
    let mut counts = [0usize; 4];
    let mut runs = 0;
    let mut last = usize::MAX;
    for _ in 0..800 {
        let i = pick(&pool, 1, Instant::ZERO);
        counts[i] += 1;
        runs += usize::from(i != last);
        last = i;
    }
    for (i, n) in counts.iter().enumerate() {
        assert!((120..=280).contains(n), "member {i} chosen {n} times of 800: {counts:?}");
    }
    assert!(runs > 400, "consecutive requests start at different members more often than not ({runs} changes)");
}

#[test]
fn most_headroom_tries_the_member_with_the_largest_tightest_fraction_first() {
    let tokens = |rpm: u64, tpm: u64| {
        LimitSet::new(
            LimitSetPolicy::new()
                .limit(LimitPolicy::gcra("rpm", quota(rpm, MINUTE, rpm)))
                .limit(LimitPolicy::token_bucket("tpm", quota(tpm, MINUTE, tpm)).counting_cost()),
        )
        .unwrap()
    };
    // a: tight on tokens, b: tight on requests. A cost counts against tokens only.
    let pool = || members(Selection::MostHeadroom, vec![tokens(100, 1_000), tokens(10, 100_000)]);
    assert_eq!(pick(&pool(), 500, Instant::ZERO), 1, "a keeps half its tokens (0.5), b 9 of 10 requests (0.9)");
    assert_eq!(pick(&pool(), 1, Instant::ZERO), 0, "a keeps 0.99 of both, b 0.9 of its requests");

    // Equal room: the earlier member; then the one the first grant left emptier.
    let pool = members(Selection::MostHeadroom, vec![rate(600, 10), rate(600, 10)]);
    let picks: Vec<usize> = (0..4).map(|_| pick(&pool, 1, Instant::ZERO)).collect();
    assert_eq!(picks, [0, 1, 0, 1]);

    // Concurrency is not headroom: b's one free permit does not make it the fullest.
    let pool = members(Selection::MostHeadroom, vec![rate(10, 10), one_at_a_time()]);
    assert_eq!(pick(&pool, 1, Instant::ZERO), 1, "b keeps 0.999 of its rate; a 0.9");

    // The local `peek` shows the member the next request would try first.
    let pool = members(Selection::MostHeadroom, vec![rate(10, 10), rate(100, 100)]);
    let seen = Backend::peek(&pool, &TenantKey::global(), Instant::ZERO);
    assert_eq!(seen.first().map(|l| l.snapshot.quota), Some(100));
}

#[test]
fn a_pool_grant_holds_concurrency_only_when_its_member_does() {
    let key = TenantKey::global();
    let pool = members(Selection::RoundRobin, vec![one_at_a_time()]);
    let held = Backend::acquire_now(&pool, &key, 1, Instant::ZERO).expect("in memory, at once").expect("granted");
    assert!(Backend::needs_release(&pool, &held));
    assert!(pool.acquire(&key, 1, Instant::ZERO).unwrap_err().as_refusal().is_some_and(|d| d.needs_release()));
    Backend::release(&pool, &key, held);
    let again = pool.acquire(&key, 1, Instant::ZERO).expect("the permit came back");
    pool.release(&key, again);

    let rates = members(Selection::RoundRobin, vec![roomy()]);
    let grant = rates.acquire(&key, 1, Instant::ZERO).unwrap();
    assert!(!Backend::needs_release(&rates, &grant));
    assert_eq!(Backend::shadow_refusal(&rates, &grant), None);
    rates.release(&key, grant);
}

#[test]
fn a_grant_names_the_shadow_limit_that_would_have_refused_it() {
    let key = TenantKey::global();
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("rps", Quota::per_second(nz!(1_000))))
            .limit(LimitPolicy::gcra("strict", Quota::per_minute(nz!(1))).shadow()),
    )
    .unwrap();
    let pool = members(Selection::RoundRobin, vec![set]);
    let first = pool.acquire(&key, 1, Instant::ZERO).unwrap();
    assert_eq!(Backend::shadow_refusal(&pool, &first), None, "the shadow limit had room");
    let second = pool.acquire(&key, 1, Instant::ZERO).expect("a shadow limit does not refuse");
    assert_eq!(Backend::shadow_refusal(&pool, &second), Some(("strict", None)));
    pool.release(&key, first);
    pool.release(&key, second);
}

#[test]
fn when_every_member_refuses_the_pool_reports_the_first_to_free() {
    let key = TenantKey::global();
    let now = Instant::ZERO;
    // b's next request is 30 s away, a's 60 s: b's wait whichever member is tried first.
    for sets in [vec![rate(1, 1), rate(2, 1)], vec![rate(2, 1), rate(1, 1)]] {
        let pool = members(Selection::RoundRobin, sets);
        let grants = [pool.acquire(&key, 1, now).unwrap(), pool.acquire(&key, 1, now).unwrap()];
        assert_eq!(refusal(pool.acquire(&key, 1, now)).retry_after(), Duration::from_secs(30));
        grants.into_iter().for_each(|g| pool.release(&key, g));
    }
    // A cost above one member's capacity is no answer while another member only needs
    // time, in either order; and a wait beats a release nobody can time.
    for sets in [vec![units(60, 5), units(2, 10)], vec![units(2, 10), units(60, 5)]] {
        let pool = members(Selection::RoundRobin, sets);
        let spent = pool.acquire(&key, 10, now).expect("the larger member takes 10");
        let d = refusal(pool.acquire(&key, 10, now));
        assert_eq!((d.retry_after(), d.needs_release()), (Duration::from_secs(300), false));
        pool.release(&key, spent);
    }
    for sets in [vec![one_at_a_time(), rate(2, 1)], vec![rate(2, 1), one_at_a_time()]] {
        let pool = members(Selection::RoundRobin, sets);
        let grants = [pool.acquire(&key, 1, now).unwrap(), pool.acquire(&key, 1, now).unwrap()];
        let d = refusal(pool.acquire(&key, 1, now));
        assert_eq!((d.retry_after(), d.needs_release()), (Duration::from_secs(30), false));
        grants.into_iter().for_each(|g| pool.release(&key, g));
    }
    // Equal waits: the refusal of the member tried first, which turns with the selection.
    let named = |name: &'static str| {
        LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra(name, Quota::per_minute(nz!(1))))).unwrap()
    };
    let pool = members(Selection::RoundRobin, vec![named("a-rpm"), named("b-rpm")]);
    let grants = [pool.acquire(&key, 1, now).unwrap(), pool.acquire(&key, 1, now).unwrap()];
    let names: Vec<&str> = (0..2).map(|_| refusal(pool.acquire(&key, 1, now)).limit()).collect();
    assert_eq!(names, ["a-rpm", "b-rpm"]);
    grants.into_iter().for_each(|g| pool.release(&key, g));
    // Above every member's capacity: never, whatever the wait.
    let pool = members(Selection::RoundRobin, vec![units(60, 5), units(60, 6)]);
    assert!(matches!(pool.acquire(&key, 7, now), Err(AcquireError::CostAboveCapacity(_))));
}

#[test]
fn a_benched_member_is_skipped_until_its_upstream_said_and_its_end_can_be_the_wait() {
    let key = TenantKey::global();
    let now = Instant::ZERO;
    let pool = members(Selection::RoundRobin, vec![roomy(), rate(2, 1)]);
    bench(&pool, 0, 10, now);
    // A shorter bench reported later does not end a longer one.
    bench(&pool, 0, 2, now);
    assert_eq!(pool.benched_until(0, now), Some(Instant::from_nanos(10 * SECOND)));
    assert_eq!(pool.benched_until(1, now), None);
    assert_eq!(pool.benched_until(5, now), None, "no such member");
    let b = pool.acquire(&key, 1, now).expect("b serves");
    assert_eq!(b.chosen().index, 1);
    // b frees in 30 s, a's bench ends in 10: the wait is a's.
    assert_eq!(refusal(pool.acquire(&key, 1, now)).retry_after(), Duration::from_secs(10));
    let ten = Instant::from_nanos(10 * SECOND);
    assert_eq!(pool.benched_until(0, ten), None, "benched until, not through, its end");
    assert_eq!(pool.acquire(&key, 1, ten).expect("a serves again").chosen().index, 0);
    pool.release(&key, b);

    // A bench longer than another member's wait leaves that wait; a shorter one is a
    // wait counted from the call's own instant.
    let later = Instant::from_nanos(100 * SECOND);
    for (secs, wait) in [(60, 30), (12, 12)] {
        let pool = members(Selection::RoundRobin, vec![roomy(), rate(2, 1)]);
        bench(&pool, 0, secs, later);
        let b = pool.acquire(&key, 1, later).unwrap();
        assert_eq!(refusal(pool.acquire(&key, 1, later)).retry_after(), Duration::from_secs(wait), "benched {secs} s");
        pool.release(&key, b);
    }

    // A bench's end is a wait where the other member can only wait for a release.
    let pool = members(Selection::RoundRobin, vec![roomy(), one_at_a_time()]);
    bench(&pool, 0, 60, now);
    let b = pool.acquire(&key, 1, now).unwrap();
    let d = refusal(pool.acquire(&key, 1, now));
    assert_eq!((d.retry_after(), d.needs_release()), (Duration::from_secs(60), false));
    pool.release(&key, b);

    // Every member benched: the upstream's refusal, until the first bench ends.
    let pool = members(Selection::RoundRobin, vec![roomy(), roomy()]);
    bench(&pool, 0, 5, now);
    bench(&pool, 1, 3, now);
    let d = refusal(pool.acquire(&key, 1, now));
    assert_eq!((d.limit(), d.retry_after()), ("upstream", Duration::from_secs(3)));
}

/// A shared store that answers what the test tells it to, and writes down what the pool
/// asked of it.
#[derive(Debug, Default)]
struct Store {
    /// The member to grant from; `None`: the store cannot answer.
    grant_from: Mutex<Option<usize>>,
    fallback: bool,
    /// Snapshots by member, for `peek` (only when set: otherwise the trait's default).
    views: Option<Vec<Vec<LimitSnapshot>>>,
    asked: Mutex<Vec<String>>,
}

impl Store {
    fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }
}

#[derive(Debug)]
struct Shared(Arc<Store>);

impl SharedAccounts for Shared {
    fn acquire(&self, cost: u64, _now: Instant) -> SharedAcquire {
        self.0.asked.lock().unwrap().push(format!("acquire {cost}"));
        let answer = match *self.0.grant_from.lock().unwrap() {
            Some(index) => Ok(SharedGrant { index, charged: cost }),
            None => Err(AcquireError::Unavailable(Unavailable::new("the store is away"))),
        };
        Box::pin(async move { answer })
    }
    fn settle(&self, grant: &mut SharedGrant, actual: u64, _now: Instant) {
        self.0.asked.lock().unwrap().push(format!("settle {} from {} to {actual}", grant.index, grant.charged));
        grant.charged = actual;
    }
    fn cancel(&self, grant: SharedGrant, _now: Instant) {
        self.0.asked.lock().unwrap().push(format!("cancel {}", grant.index));
    }
    fn observe(&self, index: usize, _report: &UpstreamReport, _now: Instant) {
        self.0.asked.lock().unwrap().push(format!("observe {index}"));
    }
    fn benched_until(&self, index: usize, _now: Instant) -> Option<Instant> {
        (index == 1).then_some(Instant::from_nanos(7))
    }
}

/// The same store, which lets the pool's local sets decide while it is away, and shows
/// the members' limits.
#[derive(Debug)]
struct WithFallback(Shared);

impl SharedAccounts for WithFallback {
    fn acquire(&self, cost: u64, now: Instant) -> SharedAcquire {
        self.0.acquire(cost, now)
    }
    fn settle(&self, grant: &mut SharedGrant, actual: u64, now: Instant) {
        self.0.settle(grant, actual, now);
    }
    fn cancel(&self, grant: SharedGrant, now: Instant) {
        self.0.cancel(grant, now);
    }
    fn observe(&self, index: usize, report: &UpstreamReport, now: Instant) {
        self.0.observe(index, report, now);
    }
    fn benched_until(&self, index: usize, now: Instant) -> Option<Instant> {
        self.0.benched_until(index, now)
    }
    fn local_fallback(&self) -> bool {
        self.0.0.fallback
    }
    fn peek(&self, index: usize, _now: Instant) -> Vec<LimitSnapshot> {
        self.0.0.views.as_ref().and_then(|v| v.get(index).cloned()).unwrap_or_default()
    }
}

fn shared_pool(store: Arc<dyn SharedAccounts>) -> LimitPool {
    LimitPool::builder(Selection::RoundRobin)
        .member("a", rate(60, 1), ())
        .member("b", rate(60, 1), ())
        .shared(store)
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_shared_pool_acquires_settles_cancels_and_learns_through_its_store() {
    let key = TenantKey::global();
    let now = Instant::ZERO;
    let store = Arc::new(Store { grant_from: Mutex::new(Some(1)), ..Store::default() });
    let pool = shared_pool(Arc::new(Shared(store.clone())));
    assert!(pool.is_shared());
    assert!(Backend::acquire_now(&pool, &key, 5, now).is_none(), "the store is asked over the network");
    let asking = Backend::acquire(&pool, &key, 5, now);
    assert!(format!("{asking:?}").contains("waiting for the shared store"), "{asking:?}");
    let mut grant = asking.await.expect("the store grants");
    assert_eq!((grant.chosen().index, &*grant.chosen().name), (1, "b"));
    assert!(!Backend::needs_release(&pool, &grant), "a store's grant holds no concurrency");
    assert_eq!(Backend::shadow_refusal(&pool, &grant), None);
    Backend::settle(&pool, &key, &mut grant, 3, now);
    Backend::cancel(&pool, &key, grant, now);
    pool.observe(0, &UpstreamReport { retry_after: Some(Duration::from_secs(9)), ..Default::default() }, now);
    assert_eq!(store.asked(), ["acquire 5", "settle 1 from 5 to 3", "cancel 1", "observe 0"]);
    // The store's benches, not the local ones, which the report did not touch.
    assert_eq!(pool.benched_until(0, now), None);
    assert_eq!(pool.benched_until(1, now), Some(Instant::from_nanos(7)));
    // The local sets were not charged: each still grants its one request.
    assert!(pool.member_set(0).unwrap().acquire(&key, 1, now).is_ok());
    assert!(pool.member_set(1).unwrap().acquire(&key, 1, now).is_ok());
    // With no `peek` of its own, the store shows no limits.
    assert!(Backend::peek(&pool, &key, now).is_empty());

    // A member the pool does not have is no grant.
    *store.grant_from.lock().unwrap() = Some(2);
    let wrong = Backend::acquire(&pool, &key, 1, now).await;
    assert!(matches!(wrong, Err(AcquireError::Unavailable(_))), "{wrong:?}");
    // Away, with no fallback (the trait's default): the store's refusal stands.
    *store.grant_from.lock().unwrap() = None;
    let away = Backend::acquire(&pool, &key, 1, now).await;
    assert!(matches!(away, Err(AcquireError::Unavailable(_))), "{away:?}");
}

#[tokio::test]
async fn a_shared_pool_falls_back_to_its_local_sets_only_when_its_store_says_so() {
    let key = TenantKey::global();
    let now = Instant::ZERO;
    let snapshot = |quota| LimitSnapshot {
        name: "rpm",
        tier: None,
        counts: tower_limits_core::Counts::Requests,
        is_semaphore: false,
        snapshot: tower_limits_core::Snapshot {
            quota,
            remaining: quota,
            reset: Duration::ZERO,
            window: Duration::ZERO,
        },
    };
    let views = vec![vec![snapshot(1)], vec![snapshot(2), snapshot(3)]];
    let store = Arc::new(Store { fallback: true, views: Some(views), ..Store::default() });
    let pool = shared_pool(Arc::new(WithFallback(Shared(store))));
    let grant = Backend::acquire(&pool, &key, 1, now).await.expect("a local set decides while the store is away");
    assert_eq!(grant.chosen().index, 0);
    let grant2 = Backend::acquire(&pool, &key, 1, now).await.expect("and the next member next");
    assert_eq!(grant2.chosen().index, 1);
    assert!(Backend::acquire(&pool, &key, 1, now).await.is_err(), "each local set had one request");
    pool.release(&key, grant);
    pool.release(&key, grant2);
    // The view of the member with the most limits.
    let seen: Vec<u64> = Backend::peek(&pool, &key, now).iter().map(|l| l.snapshot.quota).collect();
    assert_eq!(seen, [2, 3]);

    let no_fallback = Arc::new(Store { fallback: false, ..Store::default() });
    let pool = shared_pool(Arc::new(WithFallback(Shared(no_fallback))));
    assert!(matches!(Backend::acquire(&pool, &key, 1, now).await, Err(AcquireError::Unavailable(_))));
}

#[tokio::test]
async fn a_local_pool_moves_to_a_store_once() {
    let key = TenantKey::global();
    let now = Instant::ZERO;
    let pool = members(Selection::RoundRobin, vec![roomy(), roomy()]);
    assert!(!pool.is_shared());
    assert!(Backend::acquire_now(&pool, &key, 1, now).is_some_and(|r| r.is_ok()), "in memory: answered at once");
    let first = Arc::new(Store { grant_from: Mutex::new(Some(0)), ..Store::default() });
    assert!(pool.share_through(Arc::new(Shared(first.clone()))));
    assert!(pool.is_shared());
    let second = Arc::new(Store::default());
    assert!(!pool.share_through(Arc::new(Shared(second.clone()))), "shared already: nothing changes");
    let grant = Backend::acquire(&pool, &key, 4, now).await.unwrap();
    Backend::release(&pool, &key, grant);
    assert_eq!(first.asked(), ["acquire 4"]);
    assert!(second.asked().is_empty());
}

#[test]
fn a_pool_acquisition_polled_after_its_answer_says_so() {
    let pool = members(Selection::RoundRobin, vec![roomy()]);
    let fut = Backend::acquire(&pool, &TenantKey::global(), 1, Instant::ZERO);
    assert!(format!("{fut:?}").contains("ready"), "{fut:?}");
    let mut fut = pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    assert!(matches!(fut.as_mut().poll(&mut cx), Poll::Ready(Ok(_))));
    assert!(matches!(fut.as_mut().poll(&mut cx), Poll::Ready(Err(AcquireError::Unavailable(_)))));
}
