//! The OpenAI-compatible wire format of `POST /v1/embeddings`, and error bodies.

use axum::body::Body;
use http::{HeaderValue, Response, StatusCode, header};
use serde::{Deserialize, Serialize};

/// The request body: `{"model": "...", "input": "text" or ["text", ...]}`. Other fields
/// (`encoding_format`, `user`, ...) are accepted and passed on untouched.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct EmbeddingRequest {
    /// The model asked for.
    pub model: String,
    /// One text or several.
    pub input: Input,
}

/// One input text or several.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Input {
    /// A single text.
    One(String),
    /// A batch of texts.
    Many(Vec<String>),
}

impl Input {
    /// The texts, in order.
    #[must_use]
    pub fn texts(&self) -> Vec<&str> {
        match self {
            Input::One(s) => vec![s.as_str()],
            Input::Many(v) => v.iter().map(String::as_str).collect(),
        }
    }
}

/// The answer: `{"object": "list", "data": [...], "model": "...", "usage": {...}}`.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct EmbeddingResponse {
    /// Always `"list"`.
    pub object: String,
    /// One embedding per input, in order.
    pub data: Vec<Embedding>,
    /// The model that answered.
    pub model: String,
    /// What the request used.
    pub usage: UsageReport,
}

/// One embedding.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Embedding {
    /// Always `"embedding"`.
    pub object: String,
    /// The input's position.
    pub index: usize,
    /// The vector.
    pub embedding: Vec<f32>,
}

/// The `usage` member of an answer.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
pub struct UsageReport {
    /// Tokens of the input.
    pub prompt_tokens: u64,
    /// Tokens billed in all (for embeddings, the same).
    pub total_tokens: u64,
}

/// Reads only the `usage` of an answer, whatever else it carries.
#[derive(Debug, Deserialize)]
pub struct UsageOnly {
    /// The usage.
    pub usage: UsageReport,
}

/// A JSON error answer in OpenAI's shape: `{"error": {"message", "type", "code"}}`.
#[must_use]
pub fn error_response(status: StatusCode, kind: &str, code: &str, message: &str) -> Response<Body> {
    let body = serde_json::json!({ "error": { "message": message, "type": kind, "code": code } });
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// A JSON answer with status 200.
#[must_use]
pub fn json_response(body: String) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The bearer token of a request, if it has one.
#[must_use]
pub fn bearer(headers: &http::HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}
