//! Law 18: permits that live as long as the response body: held while a streamed body is
//! alive, given back when it ends, fails or is dropped, and settled to the usage it
//! reports. Law numbers are those of `crates/tower-limits/docs/laws.md`.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_limits::extract::{Cost, CostFromExtension};
use tower_limits::shell::body::OpenAiStreamUsage;
use tower_limits::{BoxError, ErrorKind, LimitError, Quota, SemaphoreLayer, TokenBucketLayer, Unfinished, nz};

/// A body fed by the test, frame by frame.
#[derive(Debug)]
struct Fed(mpsc::UnboundedReceiver<Result<Frame<Bytes>, std::io::Error>>);

impl Body for Fed {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.0.poll_recv(cx)
    }
}

type Feed = mpsc::UnboundedSender<Result<Frame<Bytes>, std::io::Error>>;

/// A service answering each request with a body the test feeds through the channel it
/// sends back.
fn streaming() -> (
    impl Service<Request<()>, Response = Response<Fed>, Error = Infallible, Future: Send> + Clone + Send + 'static,
    mpsc::UnboundedReceiver<Feed>,
) {
    let (feeds, rx) = mpsc::unbounded_channel();
    let svc = tower::service_fn(move |_req: Request<()>| {
        let (tx, body) = mpsc::unbounded_channel();
        let _ = feeds.send(tx);
        async move { Ok::<_, Infallible>(Response::new(Fed(body))) }
    });
    (svc, rx)
}

fn refused_kind(e: &BoxError) -> ErrorKind {
    e.downcast_ref::<LimitError>().expect("a limit error").kind()
}

fn data(text: &str) -> Result<Frame<Bytes>, std::io::Error> {
    Ok(Frame::data(Bytes::copy_from_slice(text.as_bytes())))
}

#[tokio::test(start_paused = true)]
async fn a_streamed_body_holds_its_slot_until_it_ends() {
    let layer = SemaphoreLayer::new(nz!(1)).hold_body();
    let (inner, mut feeds) = streaming();
    let svc = ServiceBuilder::new().layer(layer.clone()).service(inner);

    let response = svc.clone().oneshot(Request::new(())).await.unwrap();
    let feed = feeds.recv().await.unwrap();
    // The head is out, the body goes on (for an hour of paused time): the slot is held.
    feed.send(data("data: 1\n\n")).unwrap();
    tokio::time::advance(Duration::from_secs(3600)).await;
    let refused = svc.clone().oneshot(Request::new(())).await.unwrap_err();
    assert_eq!(refused_kind(&refused), ErrorKind::ConcurrencyLimited);
    assert_eq!(layer.stats().limits[0].held, 1);

    let mut body = response.into_body();
    assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap(), "data: 1\n\n");
    assert_eq!(layer.stats().limits[0].held, 1, "a frame is not the end");
    drop(feed);
    assert!(body.frame().await.is_none());
    assert_eq!(layer.stats().limits[0].held, 0, "the end gives the slot back");
    assert!(svc.oneshot(Request::new(())).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_body_dropped_mid_stream_or_failing_gives_its_slot_back() {
    let layer = SemaphoreLayer::new(nz!(1)).hold_body();
    let (inner, mut feeds) = streaming();
    let svc = ServiceBuilder::new().layer(layer.clone()).service(inner);

    // Dropped mid-stream: the client went away.
    let response = svc.clone().oneshot(Request::new(())).await.unwrap();
    let feed = feeds.recv().await.unwrap();
    feed.send(data("partial")).unwrap();
    let mut body = response.into_body();
    let _ = body.frame().await;
    assert_eq!(layer.stats().limits[0].held, 1);
    drop(body);
    assert_eq!(layer.stats().limits[0].held, 0);

    // An error frame.
    let response = svc.clone().oneshot(Request::new(())).await.unwrap();
    let feed = feeds.recv().await.unwrap();
    feed.send(Err(std::io::Error::other("upstream reset"))).unwrap();
    let mut body = response.into_body();
    assert!(body.frame().await.unwrap().is_err());
    assert_eq!(layer.stats().limits[0].held, 0, "an error gives the slot back");
    drop(body);
    assert_eq!(layer.stats().limits[0].held, 0, "and only once");

    // A body already at its end holds nothing.
    let svc = ServiceBuilder::new().layer(layer.clone()).service(tower::service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(http_body_util::Empty::<Bytes>::new()))
    }));
    let response = svc.oneshot(Request::new(())).await.unwrap();
    assert!(!response.body().is_holding());
    assert_eq!(layer.stats().limits[0].held, 0);
}

#[tokio::test(start_paused = true)]
async fn usage_is_settled_from_the_stream() {
    // 1,000 tokens, refilled over an hour: nothing comes back during the test.
    let tokens = || {
        TokenBucketLayer::new(Quota::per_hour(nz!(1_000)))
            .cost(CostFromExtension)
            .hold_body()
            .usage_from_body(OpenAiStreamUsage::default())
    };
    let request = |cost| {
        let mut req = Request::new(());
        req.extensions_mut().insert(Cost(cost));
        req
    };
    for (reports, then_fits) in [(true, true), (false, false)] {
        let (inner, mut feeds) = streaming();
        let svc = ServiceBuilder::new().layer(tokens()).service(inner);
        // Estimated 800 tokens; the stream really used 100 (when it says so).
        let response = svc.clone().oneshot(request(800)).await.unwrap();
        let feed = feeds.recv().await.unwrap();
        feed.send(data("data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n")).unwrap();
        if reports {
            feed.send(data("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":60,")).unwrap();
            feed.send(data("\"completion_tokens\":40,\"total_tokens\":100}}\n\ndata: [DONE]\n\n")).unwrap();
        }
        drop(feed);
        let _ = response.into_body().collect().await.unwrap();
        // 200 left on the estimate, 900 once settled.
        let next = svc.oneshot(request(850)).await;
        assert_eq!(next.is_ok(), then_fits, "usage reported: {reports}");
    }
}

/// Nothing leaks: streams dropped at every point (before the head, after the head, after
/// some frames, at the end, on an error) all give their slots back.
#[tokio::test(start_paused = true)]
async fn nothing_leaks_whatever_the_stream_does() {
    let layer = SemaphoreLayer::new(nz!(4)).on_cancel(Unfinished::Refund).hold_body();
    let (inner, mut feeds) = streaming();
    let mut svc = ServiceBuilder::new().layer(layer.clone()).service(inner);
    let mut seed = 0x2545_f491_u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut open = Vec::new();
    for _ in 0..400 {
        match next(6) {
            0 => {
                // Called, then dropped before the head is read.
                let fut = svc.ready().await.unwrap().call(Request::new(()));
                if let Ok(_feed) = feeds.try_recv() {}
                drop(fut);
            }
            1 | 2 => match svc.ready().await.unwrap().call(Request::new(())).await {
                Ok(response) => {
                    let feed = feeds.recv().await.unwrap();
                    open.push((response.into_body(), feed));
                }
                Err(e) => assert_eq!(refused_kind(&e), ErrorKind::ConcurrencyLimited),
            },
            _ if open.is_empty() => {}
            step => {
                let (mut body, feed) = open.swap_remove(next(open.len() as u64) as usize);
                match step {
                    3 => drop(body),
                    4 => {
                        feed.send(data("x")).unwrap();
                        drop(feed);
                        while body.frame().await.is_some() {}
                    }
                    _ => {
                        feed.send(Err(std::io::Error::other("reset"))).unwrap();
                        let _ = body.frame().await;
                        drop(body);
                    }
                }
            }
        }
        let held = layer.stats().limits[0].held;
        assert_eq!(held, open.len() as u64, "slots held are exactly the open bodies");
    }
    open.clear();
    assert_eq!(layer.stats().limits[0].held, 0);
}

/// A fair queue's slot, too, is held by the body: the next tenant waits for the stream
/// to end, not for its head.
#[tokio::test(start_paused = true)]
async fn a_fair_queue_slot_is_held_by_the_body() {
    use tower_limits::FairQueueLayer;
    use tower_limits::core::fair_queue::FairQueueConfig;

    let layer = FairQueueLayer::concurrency(FairQueueConfig::new(), 1).unwrap().hold_body();
    let (inner, mut feeds) = streaming();
    let svc = ServiceBuilder::new().layer(layer.clone()).service(inner);
    let first = svc.clone().oneshot(Request::new(())).await.unwrap();
    let feed = feeds.recv().await.unwrap();
    let second = tokio::spawn(svc.clone().oneshot(Request::new(())));
    tokio::time::advance(Duration::from_secs(60)).await;
    assert!(!second.is_finished(), "the second request waits while the first body streams");
    assert_eq!(layer.stats().queued, 1);
    drop(feed);
    let _ = first.into_body().collect().await.unwrap();
    let second = second.await.unwrap().unwrap();
    drop(feeds.recv().await.unwrap());
    let _ = second.into_body().collect().await.unwrap();
    assert_eq!(layer.stats().queued, 0);
}
