//! **Per-tenant limits in a tonic gRPC server.**
//!
//! What it shows: the standard gRPC health service behind a named [`GcraLayer`] added with
//! `Server::builder().layer(..)`, keyed per tenant (named by the `authorization`
//! metadata, standing in for real authentication; a call without it is
//! `UNAUTHENTICATED`). Refused calls are answered by the layer ([`GrpcAnswer`]) with
//! `RESOURCE_EXHAUSTED`, a message naming the limit and its tier, and the retry delay in
//! the `grpc-retry-pushback-ms` metadata that gRPC's retry policies honour. (Shared overload, a global
//! limit, would be `UNAVAILABLE`.)
//!
//! API used: `GcraLayer::new(Quota::per_second(nz!(1)).burst(nz!(3)))`,
//! `.key(KeyFn::new(..))` (a limit per key), `.refuse_with(GrpcAnswer)`, tonic's
//! `Server::builder().layer(..)`.
//!
//! Run: `cargo run -p example-tonic-health` (a scripted demonstration on a loopback port,
//! a few seconds), or `cargo run -p example-tonic-health -- --serve` to keep the server up
//! and try it with grpcurl.
#![allow(clippy::print_stdout)] // a demonstration prints what happens

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tower_limits::extract::{Extractors, KeyFn};
use tower_limits::{GRPC_RETRY_PUSHBACK_MS, GcraLayer, GrpcAnswer, Quota, TenantKey, nz};

type GrpcRequest = tonic::codegen::http::Request<tonic::body::Body>;

// ---- The limits: the one place this example builds its layer. ----

/// The layer's type: the tenant from the call's metadata, one unit per call, refusals
/// answered as gRPC statuses.
type Limits = GcraLayer<Extractors<KeyFn<fn(&GrpcRequest) -> Option<TenantKey>, GrpcRequest>>, GrpcAnswer>;

/// `quota` (a rate with a burst) for each tenant.
fn limits(quota: Quota) -> Limits {
    GcraLayer::new(quota).key(KeyFn::new(tenant as fn(&GrpcRequest) -> Option<TenantKey>)).refuse_with(GrpcAnswer)
}

// ---- The server. ----

/// The tenant named by the bearer token in the call's metadata.
fn tenant(req: &GrpcRequest) -> Option<TenantKey> {
    let token = req.headers().get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")?;
    TenantKey::single(token).ok()
}

/// Serves the health service on `listener`, limited per tenant to `quota`.
async fn serve(listener: TcpListener, quota: Quota) -> Result<(), tonic::transport::Error> {
    let (_reporter, health) = tonic_health::server::health_reporter();
    Server::builder().layer(limits(quota)).add_service(health).serve_with_incoming(TcpIncoming::from(listener)).await
}

// ---- Running it: a scripted demonstration, or a server to try by hand. ----

/// The demonstration's quota: one call a second per tenant, with a burst of three.
const QUOTA: Quota = Quota::per_second(nz!(1)).burst(nz!(3));

const USAGE: &str = "usage: cargo run -p example-tonic-health [-- --serve [--port N]]";

#[tokio::main]
async fn main() -> ExitCode {
    example_support::run(USAGE, 50051, |listener| serve(listener, QUOTA), print_commands, demo).await
}

/// Writes the health service's descriptors where grpcurl can read them (the server has no
/// reflection service: grpcurl's `-protoset` stands in for it).
fn write_protoset() -> std::io::Result<PathBuf> {
    let path = std::env::temp_dir().join("grpc-health-v1.protoset");
    std::fs::write(&path, tonic_health::pb::FILE_DESCRIPTOR_SET)?;
    Ok(path)
}

fn print_commands(addr: SocketAddr) {
    println!("serving grpc.health.v1.Health on {addr} (Ctrl-C to stop)");
    println!("limits, per tenant (the bearer token): 1 call a second with a burst of 3; try:");
    match write_protoset() {
        Ok(protoset) => {
            let p = protoset.display();
            let call = format!("grpcurl -plaintext -protoset {p} -H 'authorization: Bearer alice'");
            println!("  {call} {addr} grpc.health.v1.Health/Check");
            println!(
                "  for i in 1 2 3 4; do {call} {addr} grpc.health.v1.Health/Check; done   # the 4th: ResourceExhausted"
            );
            println!(
                "  grpcurl -plaintext -protoset {p} {addr} grpc.health.v1.Health/Check   # no key: Unauthenticated"
            );
        }
        Err(e) => println!("  (cannot write the protoset grpcurl needs to the temporary directory: {e})"),
    }
}

/// One health check as `tenant` (or without a key), as a client sees it.
async fn check(
    client: &mut HealthClient<tonic::transport::Channel>,
    tenant: Option<&str>,
) -> Result<(), tonic::Status> {
    let mut req = tonic::Request::new(HealthCheckRequest { service: String::new() });
    if let Some(t) = tenant {
        let value = format!("Bearer {t}").parse().map_err(|_| tonic::Status::invalid_argument("a bad tenant name"))?;
        req.metadata_mut().insert("authorization", value);
    }
    client.check(req).await.map(drop)
}

/// Prints one call's outcome and says whether it was `want`; returns the refusal's
/// `grpc-retry-pushback-ms`, if any.
fn show(who: &str, got: &Result<(), tonic::Status>, want: tonic::Code) -> (bool, Option<u64>) {
    let code = match got {
        Ok(()) => {
            println!("  {who:<6} Check  OK (SERVING)");
            tonic::Code::Ok
        }
        Err(status) => {
            let md = |name: &str| status.metadata().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
            println!("  {who:<6} Check  {:?}: {}", status.code(), status.message());
            if let Some(ms) = md(GRPC_RETRY_PUSHBACK_MS) {
                println!("  {:<13} metadata grpc-retry-pushback-ms: {ms}", "");
            }
            status.code()
        }
    };
    if code != want {
        println!("  ^ expected {want:?}");
    }
    let retry_ms =
        got.as_ref().err().and_then(|s| s.metadata().get(GRPC_RETRY_PUSHBACK_MS)?.to_str().ok()?.parse().ok());
    (code == want, retry_ms)
}

/// Drives the scripted sequence against the server at `addr`; returns how many answers
/// differed from what the limits promise.
async fn demo(addr: SocketAddr) -> Result<usize, tonic::transport::Error> {
    println!("tonic-health: the gRPC health service limited per tenant, server on {addr}");
    println!("limits, per tenant (the bearer token): 1 call a second with a burst of 3");
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("a socket address makes a valid URI")
        .connect()
        .await?;
    let mut client = HealthClient::new(channel);
    let mut wrong = 0;
    let mut retry_ms = None;

    println!("\n1. alice calls 4 times in a row: a burst of 3, then the layer refuses");
    for want in [tonic::Code::Ok, tonic::Code::Ok, tonic::Code::Ok, tonic::Code::ResourceExhausted] {
        let (ok, ms) = show("alice", &check(&mut client, Some("alice")).await, want);
        wrong += usize::from(!ok);
        retry_ms = ms.or(retry_ms);
    }

    println!("\n2. bob has his own limit");
    let (ok, _) = show("bob", &check(&mut client, Some("bob")).await, tonic::Code::Ok);
    wrong += usize::from(!ok);

    // The pushback is rounded up: waiting exactly that long is never early.
    let wait = Duration::from_millis(retry_ms.unwrap_or(1_000));
    println!("\n3. alice waits the {}ms of grpc-retry-pushback-ms, then calls again", wait.as_millis());
    let start = Instant::now();
    tokio::time::sleep(wait).await;
    let (ok, _) = show("alice", &check(&mut client, Some("alice")).await, tonic::Code::Ok);
    println!("  {:<13} (after {:.3}s)", "", start.elapsed().as_secs_f64());
    wrong += usize::from(!ok);

    println!("\n4. a call without a key");
    let (ok, _) = show("?", &check(&mut client, None).await, tonic::Code::Unauthenticated);
    wrong += usize::from(!ok);
    Ok(wrong)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn refused_calls_carry_the_retry_delay() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Six a minute: the next call fits ten seconds after the first, whatever the
        // timing of the test.
        let server = tokio::spawn(serve(listener, Quota::per_minute(nz!(6)).burst(nz!(3))));
        let channel =
            tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
        let mut client = HealthClient::new(channel);
        for _ in 0..3 {
            check(&mut client, Some("alice")).await.expect("within the burst");
        }
        let status = check(&mut client, Some("alice")).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains("rate limited by \"gcra\" (tier key)"), "{}", status.message());
        let retry_ms: u64 = status.metadata().get(GRPC_RETRY_PUSHBACK_MS).unwrap().to_str().unwrap().parse().unwrap();
        assert!((9_000..=10_000).contains(&retry_ms), "the next call fits ten seconds after the first: {retry_ms}");
        check(&mut client, Some("bob")).await.expect("another tenant has its own limit");
        assert_eq!(check(&mut client, None).await.unwrap_err().code(), tonic::Code::Unauthenticated);
        server.abort();
    }

    #[test]
    fn the_protoset_for_grpcurl_is_written() {
        let path = write_protoset().unwrap();
        assert_eq!(std::fs::read(path).unwrap(), tonic_health::pb::FILE_DESCRIPTOR_SET);
    }
}
