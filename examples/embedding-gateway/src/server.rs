//! The HTTP server around the router: connection hygiene, access lines and a draining
//! shutdown.
//!
//! [`serve`] accepts connections and serves HTTP/1.1 on each with hyper, or HTTP/2 when
//! the client starts with its preface (prior knowledge, as gRPC-style clients and `curl
//! --http2-prior-knowledge` do; TLS and ALPN belong to the proxy in front), and keeps
//! every connection in one of three phases, watched by a timer of its own:
//!
//! - **head**: from the accept, or from the first byte of the next request, until the
//!   request's headers are in. Longer than `header_timeout`: the connection is closed. A
//!   client that connects and sends nothing, or stalls in its headers, holds a socket for
//!   that long at most.
//! - **busy**: from the headers until the response's body is finished or dropped. The
//!   request's body has `body_timeout` (the gateway answers `408` and closes), the
//!   upstream call `upstream_timeout` (`504`); the queue is bounded by `max_wait`.
//! - **idle**: a keep-alive connection between requests. Longer than `idle_timeout`: it is
//!   closed.
//!
//! At most `max_connections` connections are open at once. When they are all taken, a
//! new connection takes the place of one that is making no use of its own, in this order:
//!
//! 1. the connection that has waited longest without a request in flight (for its
//!    headers, or idle between requests): a crowd of silent connections cannot keep real
//!    clients out;
//! 2. the connection whose request's body has made no progress for longest, if for at
//!    least [`ServerSettings::stalled_upload`]: stalled uploads cannot either (the
//!    gateway also bounds them per tenant and by pace, see [`crate::gateway::upload`]);
//! 3. one of [`HEALTH_CONNECTIONS`] places kept beyond the limit for `/healthz`,
//!    `/readyz` and `/metrics`: probes and scrapes keep answering when every connection
//!    has a request in flight. Any other request on such a place is answered `503`
//!    (`server_busy`, with `Retry-After`) and its connection closed.
//!
//! Otherwise new connections wait in the kernel's listen backlog, which costs no file
//! descriptor, until one closes. Each is logged, at most once every few seconds. Failing
//! `accept` calls (out of
//! file descriptors) are logged the same way and retried after a short pause, never in a
//! busy loop.
//!
//! # Shutdown
//!
//! When the `shutdown` future completes (SIGTERM or SIGINT in `main`): `/readyz` turns
//! not-ready first, then the listener is closed (new connections are refused), idle
//! connections and those still sending their headers are closed, and connections with a
//! request in flight finish that request
//! (its answer says `connection: close`) and close. [`serve`] returns when every
//! connection is closed, or when `shutdown_grace` has passed, whichever comes first: it
//! then drops the connections still open, so the process exits within the grace period
//! whatever clients do.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;

use crate::access::AccessInfo;
use crate::config::GatewaySettings;
use crate::health::Health;
use crate::logging::Throttle;

/// The server's settings (the `[gateway]` keys of the same names).
#[derive(Debug, Clone, Copy)]
pub struct ServerSettings {
    /// Time to send a request's headers.
    pub header_timeout: Duration,
    /// Time a keep-alive connection may sit idle.
    pub idle_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Time requests in flight get after the shutdown began.
    pub shutdown_grace: Duration,
    /// Whether to write an access line per request.
    pub access_log: bool,
    /// How long a request's body must have made no progress before its connection may
    /// give way to a new one when every connection is taken.
    pub stalled_upload: Duration,
}

/// The server's connections, counted as they come and go: in `/readyz`'s body and as the
/// `gateway_connections` gauge (label `state`: `open`, `receiving_body`, `probe_place`).
#[derive(Debug, Default)]
pub struct Connections {
    open: AtomicU64,
    receiving_body: AtomicU64,
    probe_places: AtomicU64,
}

impl Connections {
    /// Connections open, probe places included.
    #[must_use]
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections whose request's body is being received.
    #[must_use]
    pub fn receiving_body(&self) -> u64 {
        self.receiving_body.load(Ordering::Relaxed)
    }

    /// Connections on places kept for probes.
    #[must_use]
    pub fn probe_places(&self) -> u64 {
        self.probe_places.load(Ordering::Relaxed)
    }

    /// The counts as a JSON object.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "open": self.open(),
            "receiving_body": self.receiving_body(),
            "probe_places": self.probe_places(),
        })
    }

    fn add(&self, counter: &AtomicU64, state: &'static str, delta: i64) {
        let now = if delta >= 0 {
            counter.fetch_add(delta.unsigned_abs(), Ordering::Relaxed) + delta.unsigned_abs()
        } else {
            counter.fetch_sub(delta.unsigned_abs(), Ordering::Relaxed) - delta.unsigned_abs()
        };
        metrics::gauge!("gateway_connections", "state" => state).set(now as f64);
    }
}

/// Connections kept beyond `max_connections` for health probes and metrics scrapes.
pub const HEALTH_CONNECTIONS: usize = 8;

/// The paths a connection kept for probes may serve.
const HEALTH_PATHS: [&str; 3] = ["/healthz", "/readyz", "/metrics"];

impl From<&GatewaySettings> for ServerSettings {
    fn from(g: &GatewaySettings) -> Self {
        ServerSettings {
            header_timeout: g.header_timeout,
            idle_timeout: g.idle_timeout,
            max_connections: g.max_connections,
            shutdown_grace: g.shutdown_grace,
            access_log: true,
            stalled_upload: Duration::from_secs(1),
        }
    }
}

/// How the server stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped {
    /// Connections still open when `shutdown_grace` ran out, closed without finishing.
    pub cut: usize,
}

/// Where a connection is (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Head { since: Instant },
    Busy { requests: usize },
    Idle { since: Instant },
}

/// A connection's phase in one atomic word, written by the connection's reads and
/// requests and read by its watchdog and the registry. Nothing is woken when it changes:
/// the watchdog never sleeps past the earliest deadline a change could bring (see
/// [`watchdog`]), so a request costs no wake-up and no timer of its own.
#[derive(Debug)]
struct PhaseCell {
    origin: Instant,
    /// The tag in the top two bits; below them, the requests in flight (busy) or the
    /// phase's start in microseconds since `origin` (head, idle).
    word: AtomicU64,
}

const TAG_SHIFT: u32 = 62;
const HEAD: u64 = 0;
const BUSY: u64 = 1;
const IDLE: u64 = 2;
const LOW: u64 = (1 << TAG_SHIFT) - 1;

impl PhaseCell {
    /// A connection whose headers are awaited from now.
    fn new() -> Self {
        PhaseCell { origin: Instant::now(), word: AtomicU64::new(HEAD << TAG_SHIFT) }
    }

    fn since_now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(LOW).min(LOW)
    }

    fn get(&self) -> Phase {
        let word = self.word.load(Ordering::Acquire);
        let low = word & LOW;
        let since = || self.origin + Duration::from_micros(low);
        match word >> TAG_SHIFT {
            BUSY => Phase::Busy { requests: usize::try_from(low).unwrap_or(usize::MAX) },
            IDLE => Phase::Idle { since: since() },
            _ => Phase::Head { since: since() },
        }
    }

    /// The first byte of a request arrived: an idle connection awaits its headers.
    fn byte_read(&self) {
        let word = self.word.load(Ordering::Acquire);
        if word >> TAG_SHIFT == IDLE {
            let head = (HEAD << TAG_SHIFT) | self.since_now();
            // Lost to a request beginning at once: it was not idle any more.
            let _ = self.word.compare_exchange(word, head, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// A request is in flight.
    fn begin(&self) {
        let _ = self.word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
            Some(match word >> TAG_SHIFT {
                BUSY => word + 1,
                _ => (BUSY << TAG_SHIFT) | 1,
            })
        });
    }

    /// A request in flight ended: the last one leaves the connection idle.
    fn end(&self) {
        let idle = (IDLE << TAG_SHIFT) | self.since_now();
        let _ = self.word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
            Some(if word >> TAG_SHIFT == BUSY && word & LOW > 1 { word - 1 } else { idle })
        });
    }
}

type PhaseTx = Arc<PhaseCell>;

/// The connection's socket: the first byte read while idle starts the head phase.
struct Watched {
    stream: TcpStream,
    phase: PhaseTx,
}

impl AsyncRead for Watched {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.phase.byte_read();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// The progress of the request body a connection is receiving, if any: read by the
/// registry to find stalled uploads.
#[derive(Debug)]
struct Upload {
    connections: Arc<Connections>,
    origin: Instant,
    /// Whether a body is being received.
    receiving: std::sync::atomic::AtomicBool,
    /// When it last brought bytes, in milliseconds since `origin`.
    progress_ms: AtomicU64,
}

impl Upload {
    fn new(connections: Arc<Connections>) -> Self {
        Upload {
            connections,
            origin: Instant::now(),
            receiving: AtomicBool::new(false),
            progress_ms: AtomicU64::new(0),
        }
    }

    fn receiving(&self, yes: bool) {
        if self.receiving.swap(yes, Ordering::Relaxed) != yes {
            let c = &self.connections;
            c.add(&c.receiving_body, "receiving_body", if yes { 1 } else { -1 });
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.progress_ms.store(ms, Ordering::Relaxed);
    }

    /// How long the body being received has brought nothing; `None` when none is.
    fn stalled_for(&self) -> Option<Duration> {
        if !self.receiving.load(Ordering::Relaxed) {
            return None;
        }
        let since = Duration::from_millis(self.progress_ms.load(Ordering::Relaxed));
        Some(self.origin.elapsed().saturating_sub(since))
    }
}

/// A request's body that reports its progress to its connection's [`Upload`].
struct WatchedBody {
    inner: Incoming,
    upload: Arc<Upload>,
}

impl WatchedBody {
    fn new(inner: Incoming, upload: Arc<Upload>) -> Self {
        if !hyper::body::Body::is_end_stream(&inner) {
            upload.touch();
            upload.receiving(true);
        }
        WatchedBody { inner, upload }
    }
}

impl hyper::body::Body for WatchedBody {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(_))) => self.upload.touch(),
            Poll::Ready(_) => self.upload.receiving(false),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for WatchedBody {
    fn drop(&mut self) {
        self.upload.receiving(false);
    }
}

/// A request in flight on a connection: the connection is busy until it is dropped (with
/// the response's body, or with the request's future if the client went away).
struct InFlight(PhaseTx);

impl InFlight {
    fn begin(phase: &PhaseTx) -> Self {
        phase.begin();
        InFlight(phase.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// Completes with the reason when the connection has been in its phase too long.
///
/// It is never woken by a change of phase: it sleeps until its phase's deadline, or for
/// the shorter of `header_timeout` and `idle_timeout` at most, then looks again. No
/// change can bring a deadline closer than that (a phase that begins now ends its
/// allowance no sooner than one of the two from now), so it closes a connection exactly
/// at its deadline, for one timer wake-up per period per connection however many
/// requests it serves.
async fn watchdog(phase: PhaseTx, settings: ServerSettings) -> &'static str {
    let period = settings.header_timeout.min(settings.idle_timeout);
    let timer = tokio::time::sleep(period);
    let mut timer = pin!(timer);
    loop {
        let now = Instant::now();
        let deadline = match phase.get() {
            Phase::Head { since } => {
                Some((since + settings.header_timeout, "no complete headers within header_timeout"))
            }
            Phase::Idle { since } => Some((since + settings.idle_timeout, "idle beyond idle_timeout")),
            Phase::Busy { .. } => None,
        };
        let mut wake = now + period;
        if let Some((at, why)) = deadline {
            if now >= at {
                return why;
            }
            wake = wake.min(at);
        }
        timer.as_mut().reset(wake);
        timer.as_mut().await;
    }
}

/// The open connections that may be evicted to make room, with their phases.
#[derive(Debug, Default)]
struct Registry {
    next: std::sync::atomic::AtomicU64,
    open: std::sync::Mutex<std::collections::HashMap<u64, Evictable>>,
}

/// An open connection's phase, its upload, and how to tell it to close.
type Evictable = (PhaseTx, Arc<Upload>, Arc<Notify>);

impl Registry {
    fn next_id(&self) -> u64 {
        self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    fn register(&self, id: u64, phase: PhaseTx, upload: Arc<Upload>) -> Arc<Notify> {
        let evict = Arc::new(Notify::new());
        self.open.lock().unwrap_or_else(PoisonError::into_inner).insert(id, (phase, upload, evict.clone()));
        evict
    }

    /// Tells the connection that makes the least use of its place to close (see the module
    /// docs): the one waiting longest for headers or for its next request, else the one
    /// whose upload has stalled longest, at least `stalled`. What it closed, if anything.
    fn evict_one(&self, stalled: Duration) -> Option<&'static str> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let waiting = open
            .iter()
            .filter_map(|(id, (phase, _, _))| match phase.get() {
                Phase::Head { since } | Phase::Idle { since } => Some((since, *id)),
                Phase::Busy { .. } => None,
            })
            .min()
            .map(|(_, id)| (id, "waiting"));
        let chosen = waiting.or_else(|| {
            open.iter()
                .filter_map(|(id, (_, upload, _))| upload.stalled_for().filter(|s| *s >= stalled).map(|s| (s, *id)))
                .max()
                .map(|(_, id)| (id, "stalled upload"))
        });
        let (id, what) = chosen?;
        if let Some((_, _, evict)) = open.remove(&id) {
            evict.notify_one();
        }
        Some(what)
    }
}

/// A connection's place: its permit, and its entry in the registry (removed on drop).
struct Slot {
    /// Held, never read: dropping it frees the place.
    _permit: OwnedSemaphorePermit,
    registry: Arc<Registry>,
    id: u64,
    /// A place kept for probes (beyond `max_connections`).
    for_probes: bool,
    connections: Arc<Connections>,
}

impl Slot {
    fn new(
        permit: OwnedSemaphorePermit,
        registry: &Arc<Registry>,
        for_probes: bool,
        connections: &Arc<Connections>,
    ) -> Self {
        connections.add(&connections.open, "open", 1);
        if for_probes {
            connections.add(&connections.probe_places, "probe_place", 1);
        }
        Slot {
            _permit: permit,
            registry: registry.clone(),
            id: registry.next_id(),
            for_probes,
            connections: connections.clone(),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The permit is released right after, with the other fields.
        self.registry.open.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
        let c = &self.connections;
        c.add(&c.open, "open", -1);
        if self.for_probes {
            c.add(&c.probe_places, "probe_place", -1);
        }
    }
}

/// Rate-limited warnings of the accept loop.
#[derive(Debug, Default)]
struct AcceptLogs {
    full: Throttle,
    failed: Throttle,
}

/// The place a new connection found.
enum Found {
    /// One of `max_connections`.
    Place(OwnedSemaphorePermit),
    /// One kept for probes.
    ForProbes(OwnedSemaphorePermit),
    /// None: the listener is gone or the shutdown began.
    Stop,
}

/// Serves `router` on `listener` until `shutdown` completes, then drains (see the module
/// docs). `health`, when given, turns not-ready when the drain begins.
///
/// # Errors
/// The listener's address cannot be read.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    settings: ServerSettings,
    health: Option<Arc<Health>>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<Stopped> {
    let local = listener.local_addr()?;
    let permits = Arc::new(Semaphore::new(settings.max_connections.max(1)));
    let for_probes = Arc::new(Semaphore::new(HEALTH_CONNECTIONS));
    let connections_count = health.as_ref().map(|h| h.connections().clone()).unwrap_or_default();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let logs = AcceptLogs::default();
    let registry = Arc::new(Registry::default());
    let mut shutdown = pin!(shutdown);
    loop {
        while connections.try_join_next().is_some() {}
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = &mut shutdown => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                if let Some(suppressed) = logs.failed.ready() {
                    tracing::warn!(error = %e, suppressed, "cannot accept a connection (out of file descriptors?); retrying");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let found = match permits.clone().try_acquire_owned() {
            Ok(p) => Found::Place(p),
            Err(_) => {
                // Make room: a connection that makes no use of its place gives it up.
                let evicted = registry.evict_one(settings.stalled_upload);
                let probes = if evicted.is_none() { for_probes.clone().try_acquire_owned().ok() } else { None };
                if let Some(suppressed) = logs.full.ready() {
                    tracing::warn!(
                        max_connections = settings.max_connections,
                        closed = evicted.unwrap_or("none"),
                        kept_for_probes = probes.is_some(),
                        suppressed,
                        "connection limit reached: closing a connection without a request in flight or with a \
                         stalled upload, if any; otherwise a place kept for probes serves health and metrics \
                         only, or new connections wait (gateway.max_connections)"
                    );
                }
                match probes {
                    Some(p) => Found::ForProbes(p),
                    None => tokio::select! {
                        p = permits.clone().acquire_owned() => p.map_or(Found::Stop, Found::Place),
                        () = &mut shutdown => Found::Stop,
                    },
                }
            }
        };
        let (permit, for_probes_only) = match found {
            Found::Place(p) => (p, false),
            Found::ForProbes(p) => (p, true),
            Found::Stop => break,
        };
        let slot = Slot::new(permit, &registry, for_probes_only, &connections_count);
        connections.spawn(connection(stream, peer, router.clone(), settings, slot, stop_rx.clone()));
    }

    // Drain: not ready first, then no new connections, then close what is idle and let
    // what is in flight finish, within the grace period.
    if let Some(h) = &health {
        h.start_draining();
    }
    drop(listener);
    let open = connections.len();
    tracing::info!(
        %local,
        open_connections = open,
        grace_ms = settings.shutdown_grace.as_millis() as u64,
        "draining: not ready, listener closed, finishing the requests in flight"
    );
    let _ = stop_tx.send(true);
    let drained =
        tokio::time::timeout(settings.shutdown_grace, async { while connections.join_next().await.is_some() {} }).await;
    let cut = connections.len();
    if drained.is_err() {
        tracing::warn!(connections = cut, "shutdown_grace passed: closing the connections still open");
        connections.shutdown().await;
    }
    tracing::info!("stopped");
    Ok(Stopped { cut })
}

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    settings: ServerSettings,
    slot: Slot,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let phase: PhaseTx = Arc::new(PhaseCell::new());
    let upload = Arc::new(Upload::new(slot.connections.clone()));
    let evict = slot.registry.register(slot.id, phase.clone(), upload.clone());
    let io = TokioIo::new(Watched { stream, phase: phase.clone() });
    let service_phase = phase.clone();
    let for_probes = slot.for_probes;
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let in_flight = InFlight::begin(&service_phase);
        let router = router.clone();
        let req = req.map(|body| WatchedBody::new(body, upload.clone()));
        async move {
            let response = if for_probes && !HEALTH_PATHS.contains(&req.uri().path()) {
                // Answered here, not by the router: counted here.
                metrics::counter!("gateway_responses", "status" => "503", "code" => "server_busy").increment(1);
                server_busy()
            } else {
                handle(router, req, peer, in_flight, settings.access_log).await
            };
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    // HTTP/1.1, or HTTP/2 with prior knowledge (cleartext; TLS and ALPN belong to the
    // proxy in front).
    let mut builder = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    // Our own watchdog bounds the headers (hyper's timer would also cut idle keep-alive
    // connections at the header timeout).
    builder.http1().timer(TokioTimer::new()).header_read_timeout(None).keep_alive(true);
    builder.http2().timer(TokioTimer::new());
    let conn = builder.serve_connection(io, service);
    let mut conn = pin!(conn);
    let mut draining = *stop.borrow();
    if draining {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                break;
            }
            why = watchdog(phase.clone(), settings) => {
                tracing::debug!(%peer, reason = why, "closing connection");
                break;
            }
            () = evict.notified() => {
                tracing::debug!(%peer, "closing connection to make room (max_connections)");
                break;
            }
            changed = stop.changed(), if !draining => {
                if changed.is_err() || *stop.borrow() {
                    // Nothing in flight (idle, or headers still coming): close now.
                    if !matches!(phase.get(), Phase::Busy { .. }) {
                        break;
                    }
                    draining = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
    drop(slot);
}

/// The answer to a request other than a probe on a connection kept for probes.
fn server_busy() -> Response<Body> {
    let mut r = crate::api::error_response(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "server_busy",
        "every connection is taken (gateway.max_connections); please try again shortly",
    );
    tower_limits::http::write_retry_after(r.headers_mut(), crate::gateway::BACKEND_DOWN_WAIT);
    r.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
    r
}

async fn handle(
    router: Router,
    mut req: Request<WatchedBody>,
    peer: SocketAddr,
    in_flight: InFlight,
    access_log: bool,
) -> Response<Body> {
    let started = Instant::now();
    // The client's address, where axum's extractors and the auth layer look for it.
    req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let response = match router.oneshot(req.map(Body::new)).await {
        Ok(r) => r,
        Err(e) => match e {},
    };
    if access_log {
        let info = response.extensions().get::<AccessInfo>().cloned().unwrap_or_default();
        // Whole microseconds: integers read back exactly by any log pipeline.
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        tracing::info!(
            target: "access",
            client = %peer.ip(),
            method = %method,
            path = %path,
            status = response.status().as_u16(),
            code = crate::api::answer_code(response.extensions()),
            tenant = info.tenant.as_deref(),
            tokens = info.tokens,
            queued_us = info.queued.map(us),
            upstream_us = info.upstream.map(us),
            account = info.account.as_deref(),
            total_us = us(started.elapsed()),
        );
    }
    // The connection stays busy until the body is written (or dropped).
    response.map(move |body| {
        Body::new(body.map_frame(move |frame| {
            let _ = &in_flight;
            frame
        }))
    })
}
