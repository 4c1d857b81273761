//! The acquisition future: ready at once for what is decided locally, otherwise the
//! remote call, finished in the background (and its grant cancelled) if the future is
//! dropped first.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use super::{RedisBackend, RedisGrant};
use tower_limits_core::{AcquireError, Backend, Instant, TenantKey, Unavailable};

/// The acquisition future of a [`RedisBackend`]: ready at once for what is decided
/// locally, otherwise one round trip (two after a `NOSCRIPT`) bounded by the timeout.
///
/// # Cancel safety
/// Dropping it while Redis works on it finishes the call in the background and cancels
/// the grant if there was one; nothing is lost.
pub struct RedisAcquire {
    pub(super) state: AcquireState,
}

pub(super) type RemoteFuture = Pin<Box<dyn Future<Output = Result<RedisGrant, AcquireError>> + Send>>;

pub(super) enum AcquireState {
    Ready(Option<Result<RedisGrant, AcquireError>>),
    Remote { fut: RemoteFuture, backend: RedisBackend, key: TenantKey, now: Instant },
    Done,
}

impl fmt::Debug for RedisAcquire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            AcquireState::Ready(_) => "ready",
            AcquireState::Remote { .. } => "waiting for redis",
            AcquireState::Done => "done",
        };
        f.debug_struct("RedisAcquire").field("state", &state).finish()
    }
}

impl RedisAcquire {
    pub(super) fn ready(result: Result<RedisGrant, AcquireError>) -> Self {
        RedisAcquire { state: AcquireState::Ready(Some(result)) }
    }

    pub(super) fn remote(fut: RemoteFuture, backend: RedisBackend, key: TenantKey, now: Instant) -> Self {
        RedisAcquire { state: AcquireState::Remote { fut, backend, key, now } }
    }
}

impl Future for RedisAcquire {
    type Output = Result<RedisGrant, AcquireError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let out = match &mut self.state {
            AcquireState::Ready(result) => result.take(),
            AcquireState::Remote { fut, .. } => Some(ready!(fut.as_mut().poll(cx))),
            AcquireState::Done => None,
        };
        self.state = AcquireState::Done;
        Poll::Ready(out.unwrap_or_else(|| {
            Err(AcquireError::Unavailable(Unavailable::new("acquisition polled after it completed")))
        }))
    }
}

impl Drop for RedisAcquire {
    fn drop(&mut self) {
        if let AcquireState::Remote { fut, backend, key, now } = std::mem::replace(&mut self.state, AcquireState::Done)
        {
            if let Some(handle) = backend.inner.handle() {
                handle.spawn(async move {
                    if let Ok(grant) = fut.await {
                        backend.cancel(&key, grant, now);
                    }
                });
            }
        }
    }
}
