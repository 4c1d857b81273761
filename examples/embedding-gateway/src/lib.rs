//! A per-tenant embedding API gateway built on tower-limits.
//!
//! Many tenants share a few upstream provider accounts, each with its own
//! requests-per-minute and tokens-per-minute limits. The gateway keeps every tenant within
//! its plan (RPM/TPM per tier, concurrency per tenant), shares the upstream capacity
//! between tenants by weight, spreads the load over the accounts, and never makes an
//! upstream answer `429`. The binary (`src/main.rs`) serves it, runs a mock upstream,
//! and runs the demo.
//!
//! - [`config`]: the TOML file, with errors naming field and line.
//! - [`tokenizer`]: the cost of a request, counted before the call with the model's
//!   encoding, as the provider bills it.
//! - [`auth`]: bearer keys to tenant tiers.
//! - [`gateway`]: the router and its layers.
//! - [`upstream`]: the mock provider with strict limits of its own.
//! - [`server`]: the accept loop: connection timeouts and limit, access lines, draining
//!   on SIGTERM and SIGINT.
//! - [`access`]: what each layer reports for a request's access line.
//! - [`health`]: `/healthz`, `/readyz`, `/v1/models`, JSON `404` and `405`.
//! - [`roster`]: the fleet's replicas as Redis hears them, against `--replicas`.
//! - [`metrics`]: `/metrics`, the layers' numbers in Prometheus' text format.
//! - [`logging`]: `tracing-subscriber` as text or JSON, rate-limited warnings.
//! - [`demo`] and [`chart`]: the load driver, its table and its SVG chart.
//! - [`hop`]: a minimal reverse proxy, the baseline of [`bench`](mod@bench), which
//!   measures the gateway's CPU per request and added latency against it (and nginx).
//!
//! # The layers
//!
//! Each request (`POST /v1/embeddings`, or `POST /v1/chat/completions`, streamed or not)
//! meets, in order (see [`gateway`]): the auth layer (`401`, and `429` for a client
//! address that sent too many missing or unknown keys); the cost, its
//! token count with the model's encoding (`400`, `413` for a body over
//! `max_body_bytes`); its key's budgets in money per calendar period, when its plan has
//! any (`plan.NAME.TIER.budget`, priced by `[price.MODEL]`, renewed at midnight in
//! `gateway.timezone`; `429 insufficient_quota` naming the budget and its renewal; see
//! [`gateway::BudgetLayer`]); its tenant's plan, a [`LimitSetLayer`] of RPM/TPM per
//! tier and concurrency per tenant that refuses fast (`429` with `Retry-After`,
//! `retry-after-ms`, the `RateLimit` and `x-ratelimit-*` fields stating the plan, and
//! OpenAI's error object naming tier, limit and wait); then the shared upstream
//! capacity, a [`FairQueueLayer`] keyed by tenant with the configured weights and priority
//! bands (`gateway.bands`: the first band goes first, a later one keeps its minimum share
//! while it waits; the tenant's `band`, or a later one named in `gateway.band_header`),
//! whose rate is the [`LimitPool`] of upstream accounts: tenants take turns in weighted-fair order,
//! the request whose turn it is waits until an account has room and goes to that account
//! (`503` after `max_wait`). The plan's limits sit outside the queue, so a tenant over its
//! own limits never queues, and its concurrency limit bounds how much of the queue it can
//! hold. The upstream's `usage.total_tokens` settles the plan's TPM and the account's
//! mirror; what a request holds lives as long as its answer's body, so a streamed chat
//! completion keeps its concurrency until its last chunk and settles from its final
//! `usage` chunk.
//!
//! With `--redis URL --replicas N` the plans' limits and budgets and one mirror per upstream account
//! live in Redis, shared by every replica whatever the routing: a replica that gets more
//! traffic uses the capacity the others leave. Each replica keeps its own fair queue and
//! reports its backlog to the shared accounts, which take the replicas in turn by their
//! tenants' weights and demand. `N` only sizes what a replica decides alone while Redis is
//! away: `1 / N` of every limit and account.
//!
//! # Never a 429 from the upstream
//!
//! The gateway keeps a *mirror* of each account's limits (a [`LimitSet`] in a
//! [`LimitPool`]) and sends a request only once the mirror admits it. For the upstream
//! never to refuse, the mirror must be stricter than the upstream in every way the two
//! can disagree:
//!
//! 1. **Window.** A provider enforcing `L` per window `W` (a per-minute quota applied pro
//!    rata over `W`; the mock uses an exact sliding-window log) refuses whenever any span
//!    of length `W` holds more than `L`. The mirror is a GCRA with burst `b` and rate
//!    `(L - b) / (W + J)`. GCRA admits at most `rate · T + b` in every span `T` (law 1 of
//!    the library), so at most `L` in every span of `W + J`: the guarantee holds on
//!    *every* window, not on aligned ones, and a burst never borrows from the next
//!    window, as a token bucket of `L` per `W` with burst `L` would (up to `2L` in one `W`).
//! 2. **Delay.** The mirror admits at `t`, the upstream counts at `t + δ`. Two requests
//!    admitted `Δ` apart arrive `Δ - (δ₁ - δ₂)` apart: arrival spans are shorter than
//!    admission spans by at most the jitter `J`, the most by which `δ` varies (not `δ`
//!    itself: a constant delay shifts every window alike). Hence the mirror's span is
//!    `W + J`. `J` defaults to 100 ms, far above loopback and LAN jitter; the price is
//!    `W / (W + J)` of the throughput (91% with `W` = 1 s, 99.8% with `W` = 1 min).
//! 3. **Burst.** The burst `b` is a small share of `L` (`mirror.burst_percent`, 10% by
//!    default, and at least one request and `gateway.max_request_tokens` tokens, so that
//!    any allowed request fits): large enough that the pool does not serialise requests,
//!    small enough that the sustained rate stays near `L / W`.
//! 4. **Cost.** Tokens are charged at admission with an estimate that is never below the
//!    provider's count: the model's own encoding, exactly, for its inputs and messages
//!    ([`tokenizer`]); the answer's `usage.total_tokens` then settles the
//!    charge, refunding any excess. A request that fails or is cancelled keeps its charge
//!    (the upstream may have counted it).
//! 5. **Feedback.** Every upstream answer's `x-ratelimit-remaining-*` lowers the mirror
//!    when the provider knows less room than the mirror does (other clients of the same
//!    account, a restart), and a `429` would bench the account until its `Retry-After`
//!    ([`LimitPool::observe`]): a safety net, not the mechanism.
//! 6. **Learned limits.** The quota the provider states (`x-ratelimit-limit-*`) and its
//!    `429`s move each account's mirror from the declared quota: down at once, up by a
//!    quarter a window, never above `mirror.learn_ceiling_percent` of what was declared
//!    (in memory; the rule and its bounds are in [`tower_limits::core::learn`]).
//!
//! The demo checks the result: it fails if the mock upstream, whose log is written
//! independently of the library, gives a single `429`.
//!
//! [`LimitSet`]: tower_limits::LimitSet
//! [`LimitSetLayer`]: tower_limits::LimitSetLayer
//! [`FairQueueLayer`]: tower_limits::FairQueueLayer
//! [`LimitPool`]: tower_limits::LimitPool
//! [`LimitPool::observe`]: tower_limits::LimitPool::observe

pub mod access;
pub mod api;
pub mod auth;
pub mod bench;
pub mod chart;
pub mod config;
pub mod demo;
pub mod gateway;
pub mod health;
pub mod hop;
pub mod logging;
pub mod metrics;
pub mod roster;
pub mod server;
pub mod tokenizer;
pub mod upstream;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;

use axum::body::Body;
use http::Response;

/// The response future of the gateway's own services.
pub type BoxFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;
