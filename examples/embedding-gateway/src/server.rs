//! The HTTP server around the router: connection hygiene, access lines and a draining
//! shutdown.
//!
//! [`serve`] accepts connections and serves HTTP/1.1 on each with hyper, and keeps every
//! connection in one of three phases, watched by a timer of its own:
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
//! At most `max_connections` connections are open at once. When they are all taken, the
//! connection that has waited longest without a request in flight (for its headers, or
//! idle between requests) is closed to make room, and the next connection is accepted in
//! its place: a crowd of silent connections cannot keep real clients out. When every
//! connection has a request in flight, new connections wait in the kernel's listen
//! backlog, which costs no file descriptor, until one closes. Either is logged, at most
//! once every few seconds. Failing `accept` calls (out of
//! file descriptors) are logged the same way and retried after a short pause, never in a
//! busy loop.
//!
//! # Shutdown
//!
//! When the `shutdown` future completes (SIGTERM or SIGINT in `main`): `/readyz` turns
//! not-ready first, then the listener is closed (new connections are refused), idle
//! connections are closed, and connections with a request in flight finish that request
//! (its answer says `connection: close`) and close. [`serve`] returns when every
//! connection is closed, or when `shutdown_grace` has passed, whichever comes first: it
//! then drops the connections still open, so the process exits within the grace period
//! whatever clients do.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
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
}

impl From<&GatewaySettings> for ServerSettings {
    fn from(g: &GatewaySettings) -> Self {
        ServerSettings {
            header_timeout: g.header_timeout,
            idle_timeout: g.idle_timeout,
            max_connections: g.max_connections,
            shutdown_grace: g.shutdown_grace,
            access_log: true,
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

type PhaseTx = Arc<watch::Sender<Phase>>;

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
            self.phase.send_if_modified(|p| match p {
                Phase::Idle { .. } => {
                    *p = Phase::Head { since: Instant::now() };
                    true
                }
                _ => false,
            });
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

/// A request in flight on a connection: the connection is busy until it is dropped (with
/// the response's body, or with the request's future if the client went away).
struct InFlight(PhaseTx);

impl InFlight {
    fn begin(phase: &PhaseTx) -> Self {
        phase.send_modify(|p| {
            *p = match *p {
                Phase::Busy { requests } => Phase::Busy { requests: requests + 1 },
                _ => Phase::Busy { requests: 1 },
            }
        });
        InFlight(phase.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|p| {
            *p = match *p {
                Phase::Busy { requests } if requests > 1 => Phase::Busy { requests: requests - 1 },
                _ => Phase::Idle { since: Instant::now() },
            }
        });
    }
}

/// Completes with the reason when the connection has been in its phase too long.
async fn watchdog(mut phase: watch::Receiver<Phase>, settings: ServerSettings) -> &'static str {
    loop {
        let deadline = match *phase.borrow_and_update() {
            Phase::Head { since } => {
                Some((since + settings.header_timeout, "no complete headers within header_timeout"))
            }
            Phase::Idle { since } => Some((since + settings.idle_timeout, "idle beyond idle_timeout")),
            Phase::Busy { .. } => None,
        };
        match deadline {
            Some((at, why)) => {
                if Instant::now() >= at {
                    return why;
                }
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    changed = phase.changed() => if changed.is_err() { std::future::pending::<()>().await },
                }
            }
            None => {
                if phase.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    }
}

/// The open connections that may be evicted to make room, with their phases.
#[derive(Debug, Default)]
struct Registry {
    next: std::sync::atomic::AtomicU64,
    open: std::sync::Mutex<std::collections::HashMap<u64, Evictable>>,
}

/// An open connection's phase, and how to tell it to close.
type Evictable = (watch::Receiver<Phase>, Arc<Notify>);

impl Registry {
    fn next_id(&self) -> u64 {
        self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    fn register(&self, id: u64, phase: watch::Receiver<Phase>) -> Arc<Notify> {
        let evict = Arc::new(Notify::new());
        self.open.lock().unwrap_or_else(PoisonError::into_inner).insert(id, (phase, evict.clone()));
        evict
    }

    /// Tells the connection waiting longest for headers or for its next request to close;
    /// whether there was one.
    fn evict_oldest_waiting(&self) -> bool {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let oldest = open
            .iter()
            .filter_map(|(id, (phase, _))| match *phase.borrow() {
                Phase::Head { since } | Phase::Idle { since } => Some((since, *id)),
                Phase::Busy { .. } => None,
            })
            .min();
        let Some((_, id)) = oldest else { return false };
        if let Some((_, evict)) = open.remove(&id) {
            evict.notify_one();
        }
        true
    }
}

/// A connection's place: its permit, and its entry in the registry (removed on drop).
struct Slot {
    /// Held, never read: dropping it frees the place.
    _permit: OwnedSemaphorePermit,
    registry: Arc<Registry>,
    id: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The permit is released right after, with the other fields.
        self.registry.open.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
    }
}

/// Rate-limited warnings of the accept loop.
#[derive(Debug, Default)]
struct AcceptLogs {
    full: Throttle,
    failed: Throttle,
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
        let permit = match permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // Make room: the connection that has waited longest without a request in
                // flight gives its place to this one.
                let evicted = registry.evict_oldest_waiting();
                if let Some(suppressed) = logs.full.ready() {
                    tracing::warn!(
                        max_connections = settings.max_connections,
                        evicted,
                        suppressed,
                        "connection limit reached: closing the longest-waiting connection without a request \
                         in flight, if any; otherwise new connections wait (gateway.max_connections)"
                    );
                }
                tokio::select! {
                    p = permits.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                    () = &mut shutdown => break,
                }
            }
        };
        let slot = Slot { _permit: permit, registry: registry.clone(), id: registry.next_id() };
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
    let (phase_tx, phase_rx) = watch::channel(Phase::Head { since: Instant::now() });
    let phase: PhaseTx = Arc::new(phase_tx);
    let evict = slot.registry.register(slot.id, phase_rx.clone());
    let io = TokioIo::new(Watched { stream, phase: phase.clone() });
    let service_phase = phase.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let in_flight = InFlight::begin(&service_phase);
        let router = router.clone();
        async move { Ok::<_, std::convert::Infallible>(handle(router, req, peer, in_flight, settings.access_log).await) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    // Our own watchdog bounds the headers (hyper's timer would also cut idle keep-alive
    // connections at the header timeout).
    builder.timer(TokioTimer::new()).header_read_timeout(None).keep_alive(true);
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
            why = watchdog(phase_rx.clone(), settings) => {
                tracing::debug!(%peer, reason = why, "closing connection");
                break;
            }
            () = evict.notified() => {
                tracing::debug!(%peer, "closing connection to make room (max_connections)");
                break;
            }
            changed = stop.changed(), if !draining => {
                if changed.is_err() || *stop.borrow() {
                    draining = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
    drop(slot);
}

async fn handle(
    router: Router,
    mut req: Request<Incoming>,
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
