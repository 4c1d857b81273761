//! A weighted-fair tenant queue as Tower middleware: tenants share capacity in
//! proportion to their weights, by cost, whatever one of them asks for.
//!
//! A [`FairQueueLayer`] owns some capacity: concurrent slots, a rate (any
//! [`Backend`](crate::Backend), such as a [`LimitSet`](crate::LimitSet) with a global
//! tokens-per-minute limit), or both. Requests that find it busy wait in per-tenant
//! queues and are admitted in the order of start-time fair queuing
//! ([`FairQueue`](crate::core::fair_queue::FairQueue)): tenants that keep asking receive
//! cost in proportion to their weights, a tenant that was idle re-enters level with the
//! others (no banked credit), and nobody waits forever. The greedy tenant with 1,000
//! requests queued gets its share, and the small tenant with 3 gets its own, at once.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use std::time::Duration;
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use tower_limits::core::fair_queue::FairQueueConfig;
//! use tower_limits::extract::KeyFn;
//! use tower_limits::{FairQueueLayer, TenantKey};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() -> Result<(), tower_limits::PolicyError> {
//! // One upstream slot; "interactive" weighs three times "bulk". The weights are data
//! // (a configuration file): the layer checks them and names a bad one.
//! let config = FairQueueConfig::new().weight("bulk", 1).weight("interactive", 3);
//! let fair = FairQueueLayer::concurrency(config, 1)?
//!     .key(KeyFn::new(|tenant: &&'static str| TenantKey::single(tenant).ok()));
//!
//! let served = Arc::new(Mutex::new(String::new()));
//! let log = served.clone();
//! let mut svc = ServiceBuilder::new().layer(fair).service_fn(move |tenant: &'static str| {
//!     log.lock().unwrap().push(tenant.as_bytes()[0].to_ascii_uppercase() as char);
//!     async { tokio::time::sleep(Duration::from_millis(10)).await; Ok::<_, tower::BoxError>(()) }
//! });
//!
//! // The greedy tenant sends 30 requests at once, then the small one sends 10.
//! let mut calls = tokio::task::JoinSet::new();
//! for tenant in std::iter::repeat_n("bulk", 30).chain(std::iter::repeat_n("interactive", 10)) {
//!     calls.spawn(svc.ready().await.unwrap().call(tenant));
//! }
//! calls.join_all().await;
//!
//! // Bulk's first request found the slot free; from then on, interactive gets three
//! // turns in four until its queue is empty. First come, first served would have made
//! // it wait for all 30 bulk requests.
//! assert_eq!(&served.lock().unwrap()[..15], "BBIIIBIIIBIIIBI");
//! # Ok(()) }
//! ```
//!
//! # Capacity
//!
//! - [`FairQueueLayer::concurrency`]: `n` slots. An admitted request holds one until its
//!   response future completes or is dropped.
//! - [`FairQueueLayer::rate`]: each request acquires its cost from a
//!   [`Backend`](crate::Backend) when its turn comes (fairness first, then the cap). When
//!   it does not fit yet, it waits at the *gate* for the exact instant the backend names,
//!   and the others queue behind it: skipping it would let small requests starve large
//!   ones.
//! - [`FairQueueLayer::rate_and_concurrency`]: both; a request takes a slot, then the rate.
//!
//! The layer never reserves the inner service's readiness: `poll_ready` forwards it, and an
//! admitted request calls the ready clone it took along (a FIFO inner limit would decide
//! the order and defeat fairness). Put the fair queue in front of the shared resource,
//! with no other queue between them.
//!
//! # Upstream accounts: a `LimitPool` as the rate
//!
//! With a [`LimitPool`](crate::LimitPool) as the backend, the queue decides whose turn
//! it is and the pool which account serves it. [`FairQueueLayer::annotate`] with
//! [`InsertChosen`](crate::extract::InsertChosen) puts the chosen account (a
//! [`Chosen`](crate::Chosen), with its configuration) in the request's extensions, and
//! [`FairQueueLayer::usage`] with
//! [`UsageFromExtension`](crate::extract::UsageFromExtension) settles the account's grant
//! to the real usage the response reports; a settle that gives cost back lets the request
//! at the gate try again at once. Feed the upstream's answers back with
//! [`LimitPool::observe`](crate::LimitPool::observe) at [`FairQueueLayer::now`].
//!
//! # A fleet of replicas
//!
//! A fair queue is fair among the requests it sees. For replicas of one service behind a
//! balancer that routes unevenly, give each replica's layer a
//! [`FleetShares`](crate::core::fleet::FleetShares) handle with
//! [`FairQueueLayer::fleet`], and the same handle to the shared store of its rate
//! backend (`tower_limits_redis::RedisAccountsBuilder::fleet`): before every acquisition
//! the layer publishes its backlog there, the store divides the capacity between the
//! replicas by their tenants' weights and demand, and the layer queues each tenant with
//! its weight scaled by this replica's share of the tenant's demand. Tenants then share
//! the capacity by weight across the fleet. Without the handle nothing changes.
//!
//! # Tenants, weights and costs
//!
//! Each distinct [`TenantKey`](crate::TenantKey) from the key extractor (the same ones
//! as [`LimitSetLayer`](crate::LimitSetLayer): [`crate::extract`]) is a tenant. Its weight
//! is the entry of [`FairQueueConfig::weights`](crate::core::fair_queue::FairQueueConfig)
//! named by the key's `Display` form, its parts joined by `/` (`"acme"` for a one-tier key,
//! `"acme/alice"` for `["acme", "alice"]`); a key not named gets the default weight. (Keys
//! whose parts contain `/` cannot be named.) A request's cost comes from the cost
//! extractor ([`crate::extract::CostFromExtension`], a closure), one by default; it is
//! both the request's share of the queue and what it acquires from the rate.
//!
//! # Priority bands
//!
//! A configuration with bands ([`FairQueueConfig::band`](crate::core::fair_queue::FairQueueConfig::band))
//! puts interactive work ahead of batch work without starving it:
//! [`FairQueueLayer::band`](crate::FairQueueLayer::band) says which band a request waits
//! in (from a header, an extension the authentication layer set, the key). The first
//! band with requests goes first, tenants share by weight inside a band, and each band
//! keeps its minimum share of the turns while it has work, within one request (law 31;
//! the rule and its bounds are in [`FairQueue`](crate::core::fair_queue::FairQueue)'s
//! docs). A tenant's limits (`tenant_queue_limit`) count per band; the global limit
//! counts every band.
//!
//! # Refusals
//!
//! | refusal | [`ErrorKind`](crate::ErrorKind) | HTTP ([`HttpAnswer`](crate::http::HttpAnswer)) |
//! |---|---|---|
//! | the tenant's own queue is full | `TenantQueueFull` | 429, `Retry-After` when the tenant's pace is known |
//! | the whole queue is full | `QueueFull` | 503 |
//! | waited [`max_queue_time`](FairQueueLayer::max_queue_time), or the rate would pass it only later | `WaitTimedOut` | 503 |
//! | the rate backend refused for the tenant's own limit | `RateLimited` | 429 with `Retry-After` |
//! | the cost is above what the rate can ever grant | `CostAboveCapacity` | 413 |
//! | no tenant key (and no [`default_key`](FairQueueLayer::default_key)) | `MissingKey` | 401 |
//!
//! The `Retry-After` of a full tenant queue is an estimate: the interval between the
//! tenant's last two admissions while it was backlogged, less the time since the last.
//!
//! # How it works
//!
//! Every decision is made under one mutex, when something changes: a request arrives,
//! an admitted request finishes (its slot comes back), a waiter is polled or dropped.
//! There is no background task. After each change the layer *pumps*: while capacity is
//! free it takes the next request in fair order, gives it a slot and asks the rate; a
//! grant is stored for the waiter and its waker collected; wakers are woken once the
//! lock is released. A request that finds nothing queued and capacity free skips the
//! queue: the scheduler forgets everything when it empties, so this changes no later
//! decision. Costs: one lock and, with a rate, one acquisition per request on that path;
//! O(log n) in the number of backlogged tenants per queued request.
//!
//! **The gate and its timer.** When the request chosen next does not fit the rate yet,
//! it stays at the gate, holding its turn (and its slot), and *its* waiter owns the
//! timer: it sleeps until the instant the backend's refusal named (`retry_after`, to the
//! millisecond of tokio's timer), then retries. Only that task wakes at the instant: no
//! thundering herd. The duty moves with the gate: when the gate's request is admitted,
//! refused, times out or is dropped, the next request is put at the gate and its waiter
//! is woken to arm its own timer, so no wake-up is lost. A gate blocked by a semaphore of
//! the backend is retried on every release instead; a refunded grant retries it at once.
//! A remote backend's acquisition in flight is polled by the gate's waiter.
//!
//! **Limits to the guarantees.** A request chosen in fair order is charged to its tenant
//! when it reaches the gate: dropped there, its tenant's turn is spent. The backend's
//! limits are meant to be global; a refusal by a limit keyed by a tier refuses that request
//! at its turn (429) and the next one goes on.
//!
//! # Cancellation
//!
//! Every [`ResponseFuture`](future::ResponseFuture) is cancel-safe, at every point:
//!
//! - dropped while queued, it leaves the queue in O(log n)
//!   ([`FairQueue::cancel`](crate::core::fair_queue::FairQueue::cancel)); capacity did
//!   not change;
//! - dropped at the gate, its slot comes back and the next request takes the gate (and
//!   the timer); a remote backend's acquisition still in flight is dropped with it (such
//!   a backend's leases return what it may have granted);
//! - dropped after it was granted but before it was polled again, its grant is refunded
//!   to the backend, its slot comes back and the next tenant is dispatched;
//! - dropped while the inner service works, its slot comes back (the rate keeps the cost:
//!   the work may have been done).
//!
//! # With per-tenant limits
//!
//! A [`LimitSetLayer`](crate::LimitSetLayer) keyed by tenant and a fair queue compose
//! either way:
//!
//! - **Per-tenant limits outside, the fair queue inside** (recommended):
//!   `ServiceBuilder::new().layer(per_tenant).layer(fair)`. A tenant over its own quota is
//!   refused at once and never queues; the fair queue shares the upstream between the
//!   requests that are within their quotas. The outer permits are held while the request
//!   waits inside, so a per-tenant concurrency limit outside also bounds how much of the
//!   queue one tenant can fill.
//! - **The fair queue outside, per-tenant limits inside**: the fair order is decided
//!   first, then a tenant over its quota is refused (or, with
//!   [`LimitSetLayer::wait`](crate::LimitLayer::wait), waits while holding a shared
//!   slot): its turn is spent and its slot idles. Use it only when the per-tenant limits
//!   must see requests in fair order; prefer refusing fast.
//!
//! Per-tenant limits inside the fair queue's own rate backend act like the second form
//! without the wait: refused at their turn.
//!
//! ```
//! use tower::ServiceBuilder;
//! use tower_limits::core::fair_queue::FairQueueConfig;
//! use tower_limits::extract::{CostFromExtension, FromExtension};
//! use tower_limits::http::HttpAnswer;
//! use tower_limits::{FairQueueLayer, LimitPolicy, LimitSet, LimitSetLayer, LimitSetPolicy, Quota, TenantKey, nz};
//!
//! // Each org's own quota, refused fast with 429.
//! let per_tenant = LimitSetLayer::new(
//!     LimitSetPolicy::new()
//!         .tiers(["org"])
//!         .limit(
//!             LimitPolicy::token_bucket("org_tokens", Quota::per_minute(nz!(200_000)).burst(nz!(50_000)))
//!                 .per("org")
//!                 .counting_cost(),
//!         ),
//! )?
//! .key(FromExtension::<TenantKey>::new())
//! .cost(CostFromExtension)
//! .refuse_with(HttpAnswer::new());
//!
//! // The shared upstream account: 1,000,000 tokens a minute and 64 requests at once,
//! // shared by org in fair order.
//! let upstream = LimitSet::new(LimitSetPolicy::new().limit(
//!     LimitPolicy::token_bucket("upstream_tokens", Quota::per_minute(nz!(1_000_000)).burst(nz!(100_000)))
//!         .counting_cost(),
//! ))?;
//! let config = FairQueueConfig::new().weight("acme", 4).tenant_queue_limit(32);
//! let fair = FairQueueLayer::rate_and_concurrency(config, upstream, 64)?
//!     .key(FromExtension::<TenantKey>::new())
//!     .cost(CostFromExtension)
//!     .refuse_with(HttpAnswer::new());
//!
//! # let _: axum::Router = axum::Router::new().layer(ServiceBuilder::new().layer(per_tenant.clone()).layer(fair.clone()));
//! let svc = ServiceBuilder::new().layer(per_tenant).layer(fair).service_fn(|_req: http::Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(http::Response::new(String::from("embedded")))
//! });
//! # drop(svc);
//! # Ok::<(), tower_limits::PolicyError>(())
//! ```
//!
//! # Observing it
//!
//! [`FairQueueLayer::stats`] reports queue depth, slots taken, admitted requests and cost,
//! queueing time and refusals by reason; [`FairQueueLayer::tenant_stats`] one tenant's
//! queue depth, admitted cost and queueing time (kept for a bounded number of tenants).
//! Tracing (target `tower_limits`, level debug): an event for every refusal (kind,
//! tenant, limit, retry after), every request that queues, every wait at the rate gate,
//! and every admission after a wait. With the `metrics` feature: decisions, time in queue,
//! lease duration and queue depth through the `metrics` facade, the depth also per tenant
//! for the tenants named with `metrics_tenants` (see the guide's page on metrics).
//!
//! There is no shadow mode for a fair queue: its decision is an order, which cannot be
//! observed without being enforced. Watch its queue depth and time in queue, or try the
//! capacity you consider with a [`LimitSetLayer`](crate::LimitSetLayer) in shadow mode in
//! front of it.

pub mod future;
mod layer;
mod service;
mod shared;

pub use layer::FairQueueLayer;
pub use service::FairQueueService;
pub use shared::{FairQueueLayerStats, NoRate, Refusals, TenantQueueStats};
pub use tower_limits_core::fair_queue::FairQueueConfig;
