//! [`ServiceBuilder`] methods for the limit layers.

use tower::ServiceBuilder;
use tower::layer::util::Stack;

use tower_limits_core::Backend;

use crate::fair_queue::FairQueueLayer;
use crate::limit_set::LimitSetLayer;

/// Adds the limit layers to [`ServiceBuilder`], so that
/// `ServiceBuilder::new().limit_set(layer)` reads like the rest of the stack.
///
/// ```
/// use tower::ServiceBuilder;
/// use tower_limits::{LimitSetLayer, Rate, ServiceBuilderExt};
///
/// let svc = ServiceBuilder::new()
///     .limit_set(LimitSetLayer::gcra(Rate::per_second(100), 20).unwrap())
///     .service_fn(|req: String| async move { Ok::<_, std::convert::Infallible>(req) });
/// # drop(svc);
/// ```
pub trait ServiceBuilderExt<L>: sealed::Sealed {
    /// Adds a [`LimitSetLayer`].
    fn limit_set<K, C, U, R, B, A>(
        self,
        layer: LimitSetLayer<K, C, U, R, B, A>,
    ) -> WithLimits<LimitSetLayer<K, C, U, R, B, A>, L>;

    /// Adds a [`FairQueueLayer`].
    fn fair_queue<K, C, R, B: Backend, U, A>(
        self,
        layer: FairQueueLayer<K, C, R, B, U, A>,
    ) -> WithLimits<FairQueueLayer<K, C, R, B, U, A>, L>;
}

/// A [`ServiceBuilder`] with one more layer on top.
pub type WithLimits<T, L> = ServiceBuilder<Stack<T, L>>;

mod sealed {
    pub trait Sealed {}
    impl<L> Sealed for tower::ServiceBuilder<L> {}
}

impl<L> ServiceBuilderExt<L> for ServiceBuilder<L> {
    fn limit_set<K, C, U, R, B, A>(
        self,
        layer: LimitSetLayer<K, C, U, R, B, A>,
    ) -> WithLimits<LimitSetLayer<K, C, U, R, B, A>, L> {
        self.layer(layer)
    }

    fn fair_queue<K, C, R, B: Backend, U, A>(
        self,
        layer: FairQueueLayer<K, C, R, B, U, A>,
    ) -> WithLimits<FairQueueLayer<K, C, R, B, U, A>, L> {
        self.layer(layer)
    }
}
