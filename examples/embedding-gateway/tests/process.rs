//! The built binary, spawned: `--help` and `--version`, SIGTERM under load loses
//! nothing, the process exits within `shutdown_grace` whatever clients do, start-up
//! errors name what failed, `serve --redis` starts while Redis is down, and the logs
//! tell what happened.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use common::{DEADLINE, config_text, embed, http, until};
use embedding_gateway::config::KeyDigest;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

const BIN: &str = env!("CARGO_BIN_EXE_embedding-gateway");

fn temp_path(name: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "egw-process-{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A spawned `embedding-gateway serve`.
struct Gateway {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
    /// The configuration file it runs with.
    config: PathBuf,
}

impl Gateway {
    /// Spawns `serve` on the configuration `text` with `extra` arguments, and waits for the
    /// address it prints.
    fn spawn(text: &str, extra: &[&str]) -> Gateway {
        let config = temp_path("gateway.toml");
        std::fs::write(&config, text).unwrap();
        let log = temp_path("stderr.log");
        let mut child = Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&config)
            .args(["--listen", "127.0.0.1:0"])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(DEADLINE).unwrap_or_default();
        let Some(addr) = line.trim().strip_prefix("gateway listening on http://") else {
            let _ = child.kill();
            panic!("no address on stdout ({line:?}); stderr: {}", std::fs::read_to_string(&log).unwrap_or_default());
        };
        Gateway { addr: addr.parse().unwrap(), child, log, config }
    }

    fn signal(&self, name: &str) {
        // The shell's own `kill`: no procps needed.
        let status = Command::new("sh").arg("-c").arg(format!("kill -{name} {}", self.child.id())).status().unwrap();
        assert!(status.success());
    }

    /// Waits for the process to exit, within `DEADLINE`.
    async fn exited(&mut self) -> ExitStatus {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(tokio::time::Instant::now() < deadline, "still running after {DEADLINE:?}: {}", self.stderr());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An upstream that counts arrivals and answers each after `latency`, or never.
async fn slow_upstream(latency: Option<Duration>) -> (String, Arc<AtomicU64>) {
    let arrived = Arc::new(AtomicU64::new(0));
    let count = arrived.clone();
    let router = Router::new().route(
        "/v1/embeddings",
        post(move || {
            let count = count.clone();
            async move {
                count.fetch_add(1, Ordering::Relaxed);
                match latency {
                    Some(l) => tokio::time::sleep(l).await,
                    None => std::future::pending::<()>().await,
                }
                embedding_gateway::api::json_response(
                    serde_json::json!({
                        "object": "list", "data": [], "model": "m",
                        "usage": { "prompt_tokens": 1, "total_tokens": 1 }
                    })
                    .to_string(),
                )
            }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, arrived)
}

#[test]
fn help_and_version_exit_zero() {
    for args in [&["--help"][..], &["help"], &["-h"], &["serve", "--help"]] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("embedding-gateway serve"), "{args:?}");
    }
    for args in [&["--version"][..], &["version"], &["-V"]] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("embedding-gateway {}", env!("CARGO_PKG_VERSION"))
        );
    }
    let out = Command::new(BIN).arg("frobnicate").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown command \"frobnicate\""));
}

/// SIGHUP reads the configuration again and replaces the keys, given as keys or as their
/// digests; a configuration that changes more than keys changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_keys_and_nothing_else() {
    let (url, _) = slow_upstream(Some(Duration::from_millis(1))).await;
    let text = config_text("", "org = { rpm = 600000 }", &url);
    let gateway = Gateway::spawn(&text, &[]);
    let addr = gateway.addr;
    assert_eq!(embed(addr, "sk-acme-alice", "hi".into()).await.status, 200);

    // alice's key replaced by another, given by its digest only.
    let digest = KeyDigest::of("sk-acme-rotated").to_hex();
    let rotated = text.replace("key = \"sk-acme-alice\"", &format!("key_sha256 = \"{digest}\""));
    assert_ne!(rotated, text);
    std::fs::write(&gateway.config, &rotated).unwrap();
    gateway.signal("HUP");
    until("the keys reloaded", || gateway.stderr().contains("API keys reloaded")).await;
    assert_eq!(embed(addr, "sk-acme-alice", "hi".into()).await.status, 401, "the old key is gone");
    assert_eq!(embed(addr, "sk-acme-rotated", "hi".into()).await.status, 200);
    assert_eq!(embed(addr, "sk-globex-bob", "hi".into()).await.status, 200, "the others stay");

    // A tenant renamed is not a key: refused, the keys as they were.
    std::fs::write(&gateway.config, rotated.replace("name = \"globex\"", "name = \"globex2\"")).unwrap();
    gateway.signal("HUP");
    until("the reload refused", || gateway.stderr().contains("keys not reloaded")).await;
    assert_eq!(embed(addr, "sk-acme-rotated", "hi".into()).await.status, 200);
    assert!(!gateway.stderr().contains("sk-acme-rotated"), "a key in the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_answers_everything_in_flight() {
    let (url, arrived) = slow_upstream(Some(Duration::from_millis(300))).await;
    let text = config_text("shutdown_grace = \"5s\"", "org = { rpm = 600000 }", &url);
    let mut gateway = Gateway::spawn(&text, &[]);
    let addr = gateway.addr;
    let mut requests = Vec::new();
    for i in 0..16 {
        let key = if i % 2 == 0 { "sk-acme-alice" } else { "sk-globex-bob" };
        requests.push(tokio::spawn(embed(addr, key, format!("request {i}").into())));
    }
    until("16 requests in flight", || arrived.load(Ordering::Relaxed) == 16).await;
    gateway.signal("TERM");
    for r in requests {
        let answer = r.await.unwrap();
        assert_eq!(answer.status, 200, "lost in the shutdown: {answer:?}");
    }
    let status = gateway.exited().await;
    assert!(status.success(), "{status:?}: {}", gateway.stderr());
    let log = gateway.stderr();
    assert!(log.contains("signal=\"SIGTERM\""), "{log}");
    assert!(log.contains("draining"), "{log}");
    assert_eq!(log.matches("status=200").count(), 16, "one access line per request: {log}");
    assert!(TcpStream::connect(addr).await.is_err(), "still accepting after the drain");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_exits_within_the_grace_period_whatever_clients_do() {
    let (url, arrived) = slow_upstream(None).await;
    let text = config_text(
        "shutdown_grace = \"500ms\"\nheader_timeout = \"60s\"\nupstream_timeout = \"60s\"",
        "org = { rpm = 600000 }",
        &url,
    );
    let mut gateway = Gateway::spawn(&text, &[]);
    // One client stalls in its headers, another waits for an upstream that never answers.
    let mut stalled = TcpStream::connect(gateway.addr).await.unwrap();
    stalled.write_all(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let hung = tokio::spawn(embed(gateway.addr, "sk-acme-alice", "hello".into()));
    until("the request reached the upstream", || arrived.load(Ordering::Relaxed) == 1).await;
    gateway.signal("INT");
    let status = gateway.exited().await;
    assert!(status.success(), "{status:?}: {}", gateway.stderr());
    let log = gateway.stderr();
    assert!(log.contains("signal=\"SIGINT\""), "{log}");
    assert!(log.contains("shutdown_grace passed"), "{log}");
    hung.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_errors_name_what_failed() {
    let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let config = temp_path("gateway.toml");
    std::fs::write(&config, config_text("", "org = { rpm = 60 }", "http://127.0.0.1:9")).unwrap();
    let out = Command::new(BIN).args(["serve", "--listen", &addr, "--config"]).arg(&config).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("cannot listen on {addr}")), "{stderr}");

    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--redis", "http://not-redis", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("\"http://not-redis\" is not a Redis URL"), "{stderr}");

    std::fs::write(&config, config_text("max_wait = \"1s\"", "org = { rpm = 60 }", "http://127.0.0.1:9")).unwrap();
    let out = Command::new(BIN).args(["check", "--config"]).arg(&config).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`gateway.max_wait` is set twice"), "{out:?}");

    // Plain keys pass, with a warning naming the way out; digests only, without one.
    let text = config_text("", "org = { rpm = 60 }", "http://127.0.0.1:9");
    std::fs::write(&config, &text).unwrap();
    let out = Command::new(BIN).args(["check", "--config"]).arg(&config).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("warning: 2 API keys are written in plain text") && stdout.contains("key_sha256"),
        "{stdout}"
    );
    let digests = text
        .replace("key = \"sk-acme-alice\"", &format!("key_sha256 = \"{}\"", KeyDigest::of("sk-acme-alice").to_hex()))
        .replace("key = \"sk-globex-bob\"", &format!("key_sha256 = \"{}\"", KeyDigest::of("sk-globex-bob").to_hex()));
    std::fs::write(&config, &digests).unwrap();
    let out = Command::new(BIN).args(["check", "--config"]).arg(&config).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("warning"), "{out:?}");

    // Each model's encoding is stated, and an upper bound is called one.
    assert!(String::from_utf8_lossy(&out.stdout).contains("model m: tokens counted with cl100k_base"), "{out:?}");
    std::fs::write(&config, digests.replace("m = \"cl100k_base\"", "m = \"utf8_bytes\"")).unwrap();
    let out = Command::new(BIN).args(["check", "--config"]).arg(&config).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(stdout.contains("model m: tokens counted with utf8_bytes (an upper bound"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_tell_what_happened_as_json_lines() {
    // The upstream is down (nothing listens there), one connection is allowed at a time.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let text = config_text("max_connections = 1\nheader_timeout = \"300ms\"", "org = { rpm = 600000 }", &url);
    let mut gateway = Gateway::spawn(&text, &["--log-format", "json"]);
    let answer = embed(gateway.addr, "sk-acme-alice", "hello".into()).await;
    assert_eq!(answer.status, 502, "{answer:?}");
    assert_eq!(answer.json()["error"]["code"], "upstream_unreachable");
    // A silent client takes the only connection; the next one waits for it to be cut.
    let _silent = TcpStream::connect(gateway.addr).await.unwrap();
    let health = http(gateway.addr, "GET", "/healthz", None, None).await;
    assert_eq!(health.status, 200);
    gateway.signal("TERM");
    assert!(gateway.exited().await.success());

    let lines: Vec<serde_json::Value> = gateway
        .stderr()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect();
    let find = |what: &str| lines.iter().find(|l| l["message"].as_str().is_some_and(|m| m.contains(what))).cloned();
    let access = lines
        .iter()
        .find(|l| l["target"] == "access" && l["status"] == 502)
        .unwrap_or_else(|| panic!("no access line for the 502: {lines:?}"));
    assert_eq!(access["tenant"], "acme");
    assert_eq!(access["code"], "upstream_unreachable");
    assert_eq!(access["tokens"], 1, "\"hello\" is one token of cl100k_base");
    assert!(access["upstream_us"].is_u64() && access["queued_us"].is_u64(), "{access}");
    assert!(access["total_us"].is_u64() && access["client"] == "127.0.0.1", "{access}");
    let failed = find("upstream call failed").unwrap_or_else(|| panic!("no upstream warning: {lines:?}"));
    assert_eq!(failed["level"], "WARN");
    let full = find("connection limit reached").unwrap_or_else(|| panic!("no connection limit warning: {lines:?}"));
    assert_eq!(full["max_connections"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_redis_down_starts_follows_its_policy_and_recovers() {
    let Some(mut redis) = tower_limits_redis::test_support::own_redis_for("serve_with_redis_down_starts") else {
        return;
    };
    let url = redis.url();
    redis.stop();
    let (upstream, _) = slow_upstream(Some(Duration::ZERO)).await;
    let text = config_text("backend_failure = \"fail_closed\"", "org = { rpm = 600000, concurrency = 4 }", &upstream);
    let mut gateway = Gateway::spawn(&text, &["--redis", &url]);
    let addr = gateway.addr;

    let ready = http(addr, "GET", "/readyz", None, None).await;
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert_eq!(ready.json()["backend"], "redis_down");
    let refused = embed(addr, "sk-acme-alice", "hello".into()).await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.json()["error"]["code"], "limits_unavailable");

    until("the outage logged", || gateway.stderr().contains("limits backend down")).await;
    // Redis comes back (on the same port); the server lives until the end of the test.
    let _redis = tokio::task::spawn_blocking(move || {
        redis.restart().unwrap();
        redis
    })
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let ready = http(addr, "GET", "/readyz", None, None).await;
        if ready.status == 200 {
            assert_eq!(ready.json()["backend"], "redis_up");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never ready: {}", gateway.stderr());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(embed(addr, "sk-acme-alice", "hello".into()).await.status, 200);
    gateway.signal("TERM");
    assert!(gateway.exited().await.success());
    let log = gateway.stderr();
    assert!(log.contains("limits backend down"), "{log}");
    assert!(log.contains("shared through Redis"), "{log}");
}
