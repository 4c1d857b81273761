//! The priority band of a request, for a fair queue with bands.

use std::fmt;
use std::sync::Arc;

use tower_limits_core::TenantKey;

use super::{KeyExtractor, MissingKey};

/// A key extractor with a priority band read from each request by a closure: what
/// [`FairQueueLayer::band`](crate::FairQueueLayer::band) makes of the layer's key
/// extractor.
///
/// ```
/// use tower_limits::extract::{GlobalKey, KeyExtractor, WithBand};
///
/// let keys = WithBand::new(GlobalKey, |path: &&str| path.starts_with("/batch").then_some(1));
/// assert_eq!((keys.band(&"/batch/jobs"), keys.band(&"/chat")), (Some(1), None));
/// ```
pub struct WithBand<K, F> {
    keys: K,
    band: Arc<F>,
}

impl<K, F> WithBand<K, F> {
    /// `keys`, with each request's band given by `band` (`None`: the default band).
    pub fn new(keys: K, band: F) -> Self {
        WithBand { keys, band: Arc::new(band) }
    }
}

impl<K: Clone, F> Clone for WithBand<K, F> {
    fn clone(&self) -> Self {
        WithBand { keys: self.keys.clone(), band: self.band.clone() }
    }
}

impl<K: fmt::Debug, F> fmt::Debug for WithBand<K, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WithBand").field("keys", &self.keys).finish_non_exhaustive()
    }
}

impl<Req, K, F> KeyExtractor<Req> for WithBand<K, F>
where
    K: KeyExtractor<Req>,
    F: Fn(&Req) -> Option<usize> + Send + Sync + 'static,
{
    const GLOBAL: bool = K::GLOBAL;

    #[inline]
    fn extract(&self, req: &Req) -> Result<TenantKey, MissingKey> {
        self.keys.extract(req)
    }

    #[inline]
    fn band(&self, req: &Req) -> Option<usize> {
        (self.band)(req)
    }
}
