//! What the service tests share: a configuration, a raw HTTP/1.1 client over real
//! sockets, deadlines, and an upstream whose streams the test writes.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Every wait in these tests is bounded by this (a generous deadline, not a threshold:
/// what is waited for happens in well under a second).
pub const DEADLINE: Duration = Duration::from_secs(10);

/// A small configuration; `gateway` is spliced into `[gateway]`, `upstream` is the
/// accounts' base URL.
pub fn config_text(gateway: &str, plan: &str, upstream: &str) -> String {
    format!(
        r#"tiers = ["org", "user"]

[gateway]
max_request_tokens = 100
max_wait = "5s"
embedding_models = ["m"]
chat_models = ["m"]
encodings = {{ m = "cl100k_base" }}
{gateway}

[mirror]
jitter = "100ms"

[upstream]
latency = "0s"

[plan.basic]
{plan}

[[tenant]]
name = "acme"
plan = "basic"
weight = 2

[[tenant.key]]
key = "sk-acme-alice"
user = "alice"

[[tenant]]
name = "globex"
plan = "basic"

[[tenant.key]]
key = "sk-globex-bob"
user = "bob"

[[account]]
name = "primary"
base_url = "{upstream}"
api_key = "up-primary"
rpm = 60000
tpm = 6000000
window = "1s"
"#
    )
}

/// An answer read off the socket.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {:?}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    }
}

/// One request on a fresh connection (`connection: close`), read to the end.
pub async fn http(addr: SocketAddr, method: &str, path: &str, key: Option<&str>, body: Option<&str>) -> Answer {
    tokio::time::timeout(DEADLINE, async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n");
        if let Some(k) = key {
            req.push_str(&format!("authorization: Bearer {k}\r\n"));
        }
        let body = body.unwrap_or("");
        if !body.is_empty() || method == "POST" {
            req.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n", body.len()));
        }
        req.push_str("\r\n");
        req.push_str(body);
        stream.write_all(req.as_bytes()).await.expect("write");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read");
        parse(&raw)
    })
    .await
    .unwrap_or_else(|_| panic!("{method} {path}: no answer within {DEADLINE:?}"))
}

/// Parses one answer (`content-length` bodies).
pub fn parse(raw: &[u8]) -> Answer {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Answer { status, head: head.to_owned(), body: body.to_owned() }
}

/// `POST /v1/embeddings` with `input`.
pub async fn embed(addr: SocketAddr, key: &str, input: serde_json::Value) -> Answer {
    let body = serde_json::json!({ "model": "m", "input": input }).to_string();
    http(addr, "POST", "/v1/embeddings", Some(key), Some(&body)).await
}

/// Waits until `done`, checking every few milliseconds; fails after `DEADLINE`.
pub async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "{what}: not within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Opens a connection and sends a request's headers announcing a body of
/// `content_length` bytes, and `sent` of them.
pub async fn upload(addr: SocketAddr, key: &str, content_length: usize, sent: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /v1/embeddings HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: {content_length}\r\n\r\n{sent}"
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    stream
}

/// Reads from `stream` until the peer closes it (true) or `DEADLINE` passes (false);
/// what was read is appended to `into`.
pub async fn closed_by_peer(stream: &mut TcpStream, into: &mut Vec<u8>) -> bool {
    tokio::time::timeout(DEADLINE, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => into.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .is_ok()
}

/// An upstream whose every answer is a `text/event-stream` the test writes: each call
/// hands the test the sending end of its body (dropping it ends the stream).
pub fn scripted() -> (
    embedding_gateway::gateway::Transport,
    tokio::sync::mpsc::UnboundedReceiver<tokio::sync::mpsc::Sender<bytes::Bytes>>,
) {
    let (streams_tx, streams_rx) = tokio::sync::mpsc::unbounded_channel();
    let transport =
        tower::util::BoxCloneSyncService::new(tower::service_fn(move |_req: http::Request<axum::body::Body>| {
            let (tx, rx) = tokio::sync::mpsc::channel(8);
            let _ = streams_tx.send(tx);
            async move {
                let mut r = http::Response::new(axum::body::Body::new(embedding_gateway::api::ChannelBody(rx)));
                r.headers_mut().insert("content-type", http::HeaderValue::from_static("text/event-stream"));
                Ok::<_, tower::BoxError>(r)
            }
        }));
    (transport, streams_rx)
}

/// A chat completion of `text` by acme's alice, reserving `max_tokens`, streamed (with
/// the final usage chunk asked for) or not.
pub fn chat(text: &str, max_tokens: u64, stream: bool) -> http::Request<axum::body::Body> {
    let body = serde_json::json!({
        "model": "m",
        "messages": [{ "role": "user", "content": text }],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": { "include_usage": true },
    });
    http::Request::post("/v1/chat/completions")
        .header("authorization", "Bearer sk-acme-alice")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_string()))
        .unwrap()
}

/// A stream's chunk carrying `word`.
pub fn content(word: &str) -> bytes::Bytes {
    embedding_gateway::api::sse_event(&serde_json::json!({
        "object": "chat.completion.chunk",
        "choices": [{ "index": 0, "delta": { "content": word } }],
    }))
}

/// A stream's final usage chunk.
pub fn usage_chunk(prompt: u64, completion: u64) -> bytes::Bytes {
    embedding_gateway::api::sse_event(&serde_json::json!({
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": { "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion },
    }))
}
