//! A tonic gRPC server behind a limit set: the standard health service, limited per
//! tenant (named by the `authorization` metadata, standing in for real authentication) to
//! a burst of three calls and one every ten seconds. Refused calls are answered by the layer with
//! `RESOURCE_EXHAUSTED` and the retry delay in the `retry-after` and `retry-after-ms`
//! metadata (shared overload, a global limit, would be `UNAVAILABLE`).
//!
//! Run it with `cargo run -p example-tonic-health`.
#![allow(clippy::print_stdout)] // a demo server says where it listens

use tokio::net::TcpListener;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tower_limits::extract::KeyFn;
use tower_limits::{GrpcAnswer, LimitPolicy, LimitSetLayer, LimitSetPolicy, Rate, TenantKey};

type GrpcRequest = tonic::codegen::http::Request<tonic::body::Body>;

/// The tenant named by the bearer token in the call's metadata.
fn tenant(req: &GrpcRequest) -> Option<TenantKey> {
    let token = req.headers().get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")?;
    TenantKey::single(token).ok()
}

/// Serves the health service on `listener`, limited per tenant.
async fn serve(listener: TcpListener) -> Result<(), tonic::transport::Error> {
    let (_reporter, health) = tonic_health::server::health_reporter();
    let policy =
        LimitSetPolicy::new().tiers(["tenant"]).limit(LimitPolicy::gcra("calls", Rate::per_minute(6), 3).per("tenant"));
    let limits = LimitSetLayer::new(policy)
        .expect("a valid policy")
        .key(KeyFn::new(tenant as fn(&GrpcRequest) -> Option<TenantKey>))
        .reject_with(GrpcAnswer);
    Server::builder().layer(limits).add_service(health).serve_with_incoming(TcpIncoming::from(listener)).await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listener = TcpListener::bind("127.0.0.1:50051").await?;
    println!("gRPC health service on {}", listener.local_addr()?);
    serve(listener).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    use super::*;

    fn check_as(tenant: &str) -> tonic::Request<HealthCheckRequest> {
        let mut req = tonic::Request::new(HealthCheckRequest { service: String::new() });
        req.metadata_mut().insert("authorization", format!("Bearer {tenant}").parse().unwrap());
        req
    }

    #[tokio::test]
    async fn refused_calls_carry_the_retry_delay() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(listener));
        let channel =
            tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
        let mut client = HealthClient::new(channel);
        for _ in 0..3 {
            client.check(check_as("alice")).await.expect("within the burst");
        }
        let status = client.check(check_as("alice")).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains("rate limited by \"calls\" (tier tenant)"), "{}", status.message());
        let retry_ms: u64 = status.metadata().get("retry-after-ms").unwrap().to_str().unwrap().parse().unwrap();
        assert!((9_000..=10_000).contains(&retry_ms), "the next call fits ten seconds after the first: {retry_ms}");
        assert_eq!(status.metadata().get("retry-after").unwrap(), "10");
        client.check(check_as("bob")).await.expect("another tenant has its own limit");
        let anonymous = client.check(tonic::Request::new(HealthCheckRequest { service: String::new() })).await;
        assert_eq!(anonymous.unwrap_err().code(), tonic::Code::Unauthenticated);
        server.abort();
    }
}
