//! The OpenAI-compatible wire format of `POST /v1/embeddings` and `POST
//! /v1/chat/completions` (streamed as server-sent events or not), and error bodies.
//!
//! Every error the gateway itself answers, whatever its status, has a JSON body in
//! OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

use axum::body::{Body, Bytes};
use http::{HeaderValue, Response, StatusCode, header};
use serde::{Deserialize, Serialize};

use crate::tokenizer::{Encoding, MESSAGE_OVERHEAD, NAME_OVERHEAD, REPLY_PRIMING};

/// The most inputs one request may carry (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// A request body of `POST /v1/embeddings`, checked: `{"model": "...", "input": ...}`
/// with the optional `dimensions` and `encoding_format`. Other fields (`user`, ...) are
/// accepted and passed on untouched.
///
/// `input` takes every form OpenAI takes: a string, an array of strings, an array of
/// token ids, or an array of arrays of token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingRequest {
    /// The model asked for.
    pub model: String,
    /// The inputs, in order (one for a string or a single token array).
    pub inputs: Vec<Input>,
    /// The length of the vectors asked for, if any.
    pub dimensions: Option<u64>,
    /// How the vectors are to be encoded.
    pub encoding_format: EncodingFormat,
}

/// One input of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// A text.
    Text(String),
    /// Token ids, each one token.
    Tokens(Vec<u64>),
}

impl Input {
    /// Its tokens: counted with `encoding` for a text, one per id for token ids.
    #[must_use]
    pub fn tokens(&self, encoding: Encoding) -> u64 {
        match self {
            Input::Text(t) => encoding.count(t),
            Input::Tokens(ids) => ids.len() as u64,
        }
    }

    /// A stable text standing for the input, to seed the mock's embedding with.
    #[must_use]
    pub fn seed_text(&self) -> String {
        match self {
            Input::Text(t) => t.clone(),
            Input::Tokens(ids) => ids.iter().map(u64::to_string).collect::<Vec<_>>().join(" "),
        }
    }
}

/// How vectors are encoded in the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EncodingFormat {
    /// Arrays of numbers (the default).
    #[default]
    Float,
    /// Base64 of the little-endian `f32`s, as OpenAI sends it.
    Base64,
}

/// Why a request body was refused: the parameter at fault and a message in the terms of
/// the API (`400`, `invalid_request_error`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestError {
    /// The parameter at fault (`input`, `model`, ...), if one is.
    pub param: Option<&'static str>,
    /// A short machine-readable code.
    pub code: &'static str,
    /// What is wrong, for a person.
    pub message: String,
}

impl RequestError {
    fn new(param: Option<&'static str>, code: &'static str, message: impl Into<String>) -> Self {
        RequestError { param, code, message: message.into() }
    }

    /// The `400` answer.
    #[must_use]
    pub fn response(&self) -> Response<Body> {
        error_with_param(StatusCode::BAD_REQUEST, "invalid_request_error", self.code, self.param, &self.message)
    }
}

const INPUT_FORMS: &str = "a string, an array of strings, an array of token ids (whole numbers) \
     or an array of arrays of token ids";

impl EmbeddingRequest {
    /// Reads and checks a request body.
    ///
    /// # Errors
    /// What is wrong with it, naming the parameter.
    pub fn parse(body: &[u8]) -> Result<Self, RequestError> {
        let value: serde_json::Value = serde_json::from_slice(body)
            .map_err(|e| RequestError::new(None, "invalid_json", format!("the body is not valid JSON: {e}")))?;
        let serde_json::Value::Object(map) = value else {
            return Err(RequestError::new(
                None,
                "invalid_json",
                "the body must be a JSON object such as {\"model\": \"...\", \"input\": \"some text\"}",
            ));
        };
        let model = match map.get("model") {
            Some(serde_json::Value::String(m)) if !m.is_empty() => m.clone(),
            None | Some(serde_json::Value::Null) => {
                return Err(RequestError::new(Some("model"), "missing_model", "you must name a `model`"));
            }
            Some(_) => {
                return Err(RequestError::new(Some("model"), "invalid_model", "`model` must be a non-empty string"));
            }
        };
        let input = map.get("input").filter(|v| !v.is_null()).ok_or_else(|| {
            RequestError::new(Some("input"), "missing_input", format!("`input` is missing: give {INPUT_FORMS}"))
        })?;
        let inputs = parse_input(input)?;
        let dimensions = match map.get("dimensions") {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(d) if (1..=65_536).contains(&d) => Some(d),
                _ => {
                    return Err(RequestError::new(
                        Some("dimensions"),
                        "invalid_dimensions",
                        "`dimensions` must be a whole number of at least 1",
                    ));
                }
            },
        };
        let encoding_format = match map.get("encoding_format") {
            None | Some(serde_json::Value::Null) => EncodingFormat::Float,
            Some(serde_json::Value::String(f)) if f == "float" => EncodingFormat::Float,
            Some(serde_json::Value::String(f)) if f == "base64" => EncodingFormat::Base64,
            Some(_) => {
                return Err(RequestError::new(
                    Some("encoding_format"),
                    "invalid_encoding_format",
                    "`encoding_format` must be \"float\" or \"base64\"",
                ));
            }
        };
        Ok(EmbeddingRequest { model, inputs, dimensions, encoding_format })
    }

    /// The tokens of every input, counted with `encoding`.
    #[must_use]
    pub fn tokens(&self, encoding: Encoding) -> u64 {
        self.inputs.iter().map(|i| i.tokens(encoding)).sum()
    }

    /// The tokens of every input if there are at most `limit` in all, else `None`
    /// (counting stops about where the limit is passed).
    #[must_use]
    pub fn tokens_within(&self, encoding: Encoding, limit: u64) -> Option<u64> {
        self.inputs.iter().try_fold(0u64, |sum, input| {
            let left = limit - sum;
            let n = match input {
                Input::Text(t) => encoding.count_within(t, left)?,
                Input::Tokens(ids) => Some(ids.len() as u64).filter(|&n| n <= left)?,
            };
            Some(sum + n)
        })
    }
}

fn parse_input(input: &serde_json::Value) -> Result<Vec<Input>, RequestError> {
    use serde_json::Value;
    let wrong = || RequestError::new(Some("input"), "invalid_input", format!("`input` must be {INPUT_FORMS}"));
    let empty = |what: String| {
        RequestError::new(Some("input"), "invalid_input", format!("{what} is empty: every input needs text or tokens"))
    };
    // Every encoding's ids fit 32 bits (the largest vocabularies hold some 200,000).
    let token = |v: &Value, at: String| {
        v.as_u64().filter(|id| *id <= u64::from(u32::MAX)).ok_or_else(|| {
            RequestError::new(
                Some("input"),
                "invalid_input",
                format!("{at} is not a token id: token ids are whole numbers from 0 to {}", u32::MAX),
            )
        })
    };
    match input {
        Value::String(s) if s.is_empty() => Err(empty("`input`".into())),
        Value::String(s) => Ok(vec![Input::Text(s.clone())]),
        Value::Array(items) => {
            if items.is_empty() {
                return Err(empty("`input`".into()));
            }
            if items.len() > MAX_INPUTS {
                return Err(RequestError::new(
                    Some("input"),
                    "too_many_inputs",
                    format!("`input` has {} items; a request may carry at most {MAX_INPUTS}", items.len()),
                ));
            }
            match &items[0] {
                // One token array.
                Value::Number(_) => {
                    let ids = items
                        .iter()
                        .enumerate()
                        .map(|(i, v)| token(v, format!("`input[{i}]`")))
                        .collect::<Result<Vec<_>, _>>()?;
                    Ok(vec![Input::Tokens(ids)])
                }
                Value::String(_) => items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::String(s) if s.is_empty() => Err(empty(format!("`input[{i}]`"))),
                        Value::String(s) => Ok(Input::Text(s.clone())),
                        _ => Err(wrong()),
                    })
                    .collect(),
                Value::Array(_) => items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::Array(ids) if ids.is_empty() => Err(empty(format!("`input[{i}]`"))),
                        Value::Array(ids) => ids
                            .iter()
                            .enumerate()
                            .map(|(j, t)| token(t, format!("`input[{i}][{j}]`")))
                            .collect::<Result<Vec<_>, _>>()
                            .map(Input::Tokens),
                        _ => Err(wrong()),
                    })
                    .collect(),
                _ => Err(wrong()),
            }
        }
        _ => Err(wrong()),
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
    pub embedding: Vector,
}

/// A vector as sent: numbers, or base64 of little-endian `f32`s.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Vector {
    /// `encoding_format: "float"`.
    Float(Vec<f32>),
    /// `encoding_format: "base64"`.
    Base64(String),
}

/// Base64 (standard alphabet, padded) of the little-endian bytes of `v`: what OpenAI
/// sends for `encoding_format: "base64"`.
#[must_use]
pub fn base64_f32(v: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The `usage` member of an answer.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
pub struct UsageReport {
    /// Tokens of the input.
    pub prompt_tokens: u64,
    /// Tokens billed in all (for embeddings, the same).
    pub total_tokens: u64,
}

/// The `usage.total_tokens` of an answer. OpenAI's answers end with their `usage`, so it
/// is read from there, without parsing the vectors before it; an answer shaped otherwise
/// is read whole.
///
/// ```
/// use embedding_gateway::api::usage_total;
///
/// let answer = br#"{"object":"list","data":[{"embedding":[0.1,0.2]}],"model":"m","usage":{"prompt_tokens":3,"total_tokens":3}}"#;
/// assert_eq!(usage_total(answer), Some(3));
/// assert_eq!(usage_total(br#"{"usage": {"prompt_tokens": 2, "total_tokens": 2}, "data": []}"#), Some(2));
/// assert_eq!(usage_total(br#"{"data": []}"#), None);
/// // What comes before the usage is not read.
/// assert_eq!(usage_total(br#"{"data": [not json], "usage": {"prompt_tokens": 4, "total_tokens": 4}}"#), Some(4));
/// ```
#[must_use]
pub fn usage_total(body: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"usage\"";
    let tail = body.windows(KEY.len()).rposition(|w| w == KEY).and_then(|at| {
        let rest = &body[at + KEY.len()..];
        let colon = rest.iter().position(|b| !b.is_ascii_whitespace())?;
        if rest[colon] != b':' {
            return None;
        }
        let mut values = serde_json::Deserializer::from_slice(&rest[colon + 1..]).into_iter::<UsageReport>();
        values.next()?.ok()
    });
    tail.or_else(|| serde_json::from_slice::<UsageOnly>(body).ok().map(|u| u.usage)).map(|u| u.total_tokens)
}

/// Reads only the `usage` of an answer, whatever else it carries.
#[derive(Debug, Deserialize)]
pub struct UsageOnly {
    /// The usage.
    pub usage: UsageReport,
}

/// A JSON error answer in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`
/// (`param` null).
#[must_use]
pub fn error_response(status: StatusCode, kind: &str, code: &'static str, message: &str) -> Response<Body> {
    error_with_param(status, kind, code, None, message)
}

/// The `code` of the gateway's own error answer, in the answer's extensions: the `code`
/// label of `gateway_responses` (see [`crate::metrics`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorCode(pub &'static str);

/// The `code` an answer's error object carries, read from its extensions: the gateway's
/// own ([`ErrorCode`]), or that of a limit layer's refusal; `None` for a success.
#[must_use]
pub fn answer_code(extensions: &http::Extensions) -> Option<&'static str> {
    match (extensions.get::<ErrorCode>(), extensions.get::<tower_limits::LimitError>()) {
        (Some(own), _) => Some(own.0),
        (None, Some(refusal)) => Some(refusal.openai_code()),
        (None, None) => None,
    }
}

/// A JSON error answer in OpenAI's shape naming the parameter at fault.
#[must_use]
pub fn error_with_param(
    status: StatusCode,
    kind: &str,
    code: &'static str,
    param: Option<&str>,
    message: &str,
) -> Response<Body> {
    let body = serde_json::json!({ "error": { "message": message, "type": kind, "param": param, "code": code } });
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.extensions_mut().insert(ErrorCode(code));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// Whether `body` is an error in OpenAI's shape (`{"error": {"message": ...}}`).
#[must_use]
pub fn is_openai_error(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|v| v["error"]["message"].is_string())
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

/// A request body of `POST /v1/chat/completions`, checked: `{"model", "messages"}` with
/// the optional `stream`, `stream_options.include_usage`, `max_tokens` (or
/// `max_completion_tokens`), `n` and `tools`. Other fields are passed on untouched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatRequest {
    /// The model asked for.
    pub model: String,
    /// The messages, in order.
    pub messages: Vec<ChatMessage>,
    /// The JSON text of `tools` (or the older `functions`), if the request has them: the
    /// model reads their definitions as part of its prompt.
    pub tools: Option<String>,
    /// Whether the answer is streamed as server-sent events.
    pub stream: bool,
    /// Whether a streamed answer ends with a `usage` chunk.
    pub include_usage: bool,
    /// The most tokens each answer may have.
    pub max_tokens: Option<u64>,
    /// How many answers are asked for (`n`, 1 by default): each is billed.
    pub choices: u64,
}

/// The most answers one chat request may ask for (`n`, OpenAI's limit).
pub const MAX_CHOICES: u64 = 128;

/// What the provider counts of one chat message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The participant's `name`, if given.
    pub name: Option<String>,
    /// Its text: the content, or the text parts of a content given as parts, joined by
    /// new lines.
    pub text: String,
    /// The JSON text of its `tool_calls` (or `function_call`), if it has them.
    pub tool_calls: Option<String>,
    /// How many images its content parts carry (`"type": "image_url"`).
    pub images: u64,
}

impl ChatMessage {
    /// The message's tokens with its framing, if at most `limit`.
    fn tokens_within(&self, encoding: Encoding, limit: u64) -> Option<u64> {
        let mut left = limit.checked_sub(MESSAGE_OVERHEAD)?;
        take(&mut left, encoding, &self.role)?;
        take(&mut left, encoding, &self.text)?;
        if let Some(name) = &self.name {
            take(&mut left, encoding, name)?;
            left = left.checked_sub(NAME_OVERHEAD)?;
        }
        if let Some(calls) = &self.tool_calls {
            take(&mut left, encoding, calls)?;
        }
        Some(limit - left)
    }
}

/// Takes the tokens of `text` from `left`; `None` when there are more.
fn take(left: &mut u64, encoding: Encoding, text: &str) -> Option<()> {
    *left -= encoding.count_within(text, *left)?;
    Some(())
}

impl ChatRequest {
    /// Reads and checks a request body.
    ///
    /// # Errors
    /// What is wrong with it, naming the parameter.
    pub fn parse(body: &[u8]) -> Result<Self, RequestError> {
        use serde_json::Value;
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| RequestError::new(None, "invalid_json", format!("the body is not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(RequestError::new(
                None,
                "invalid_json",
                "the body must be a JSON object such as {\"model\": \"...\", \"messages\": [...]}",
            ));
        };
        let model = match map.get("model") {
            Some(Value::String(m)) if !m.is_empty() => m.clone(),
            None | Some(Value::Null) => {
                return Err(RequestError::new(Some("model"), "missing_model", "you must name a `model`"));
            }
            Some(_) => {
                return Err(RequestError::new(Some("model"), "invalid_model", "`model` must be a non-empty string"));
            }
        };
        let wrong = || {
            RequestError::new(
                Some("messages"),
                "invalid_messages",
                "`messages` must be a non-empty array of {\"role\": ..., \"content\": ...} objects",
            )
        };
        let Some(Value::Array(items)) = map.get("messages") else { return Err(wrong()) };
        if items.is_empty() {
            return Err(wrong());
        }
        let json_text = |v: Option<&Value>| v.filter(|v| !v.is_null()).map(Value::to_string);
        let messages = items
            .iter()
            .map(|m| {
                let mut images = 0;
                let text = match m.get("content") {
                    Some(Value::String(text)) => text.clone(),
                    Some(Value::Array(parts)) => {
                        images =
                            parts.iter().filter(|p| p.get("type").and_then(Value::as_str) == Some("image_url")).count()
                                as u64;
                        parts.iter().filter_map(|p| p.get("text")?.as_str()).collect::<Vec<_>>().join("\n")
                    }
                    // An assistant's message with tool calls may have no content.
                    Some(Value::Null) => String::new(),
                    None if m.get("tool_calls").is_some() || m.get("function_call").is_some() => String::new(),
                    _ => return Err(wrong()),
                };
                let role = match m.get("role") {
                    Some(Value::String(r)) => r.clone(),
                    _ => return Err(wrong()),
                };
                let name = m.get("name").and_then(Value::as_str).map(str::to_owned);
                let tool_calls = json_text(m.get("tool_calls").or_else(|| m.get("function_call")));
                Ok(ChatMessage { role, name, text, tool_calls, images })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let tools = json_text(map.get("tools").or_else(|| map.get("functions")));
        let stream = match map.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(RequestError::new(Some("stream"), "invalid_stream", "`stream` must be true or false"));
            }
        };
        let include_usage =
            map.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
        let max_tokens = match map.get("max_completion_tokens").or_else(|| map.get("max_tokens")) {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(n) if n >= 1 => Some(n),
                _ => {
                    return Err(RequestError::new(
                        Some("max_tokens"),
                        "invalid_max_tokens",
                        "`max_tokens` must be a whole number of at least 1",
                    ));
                }
            },
        };
        let choices = match map.get("n") {
            None | Some(Value::Null) => 1,
            Some(v) => match v.as_u64() {
                Some(n) if (1..=MAX_CHOICES).contains(&n) => n,
                _ => {
                    return Err(RequestError::new(
                        Some("n"),
                        "invalid_n",
                        format!("`n` must be a whole number from 1 to {MAX_CHOICES}"),
                    ));
                }
            },
        };
        Ok(ChatRequest { model, messages, tools, stream, include_usage, max_tokens, choices })
    }

    /// The tokens of the prompt's text, counted with `encoding`: every message with its
    /// framing, the tools' definitions and the answer's priming (see
    /// [`crate::tokenizer`]); images are not in it ([`Self::images`]).
    #[must_use]
    pub fn prompt_tokens(&self, encoding: Encoding) -> u64 {
        self.prompt_tokens_within(encoding, u64::MAX).unwrap_or(u64::MAX)
    }

    /// How many images the messages carry: the provider bills each by its size, which
    /// the gateway does not fetch (see [`crate::tokenizer`]).
    #[must_use]
    pub fn images(&self) -> u64 {
        self.messages.iter().map(|m| m.images).sum()
    }

    /// The tokens of the prompt's text if at most `limit`, else `None` (counting stops
    /// about where the limit is passed); images are not in it ([`Self::images`]).
    #[must_use]
    pub fn prompt_tokens_within(&self, encoding: Encoding, limit: u64) -> Option<u64> {
        let mut left = limit.checked_sub(REPLY_PRIMING)?;
        if let Some(tools) = &self.tools {
            take(&mut left, encoding, tools)?;
        }
        for m in &self.messages {
            left -= m.tokens_within(encoding, left)?;
        }
        Some(limit - left)
    }

    /// The tokens reserved for the answers, every one of the `n` billed: `max_tokens`
    /// each when the request gives it, else `default` each when one is configured, else
    /// what `max_request_tokens` leaves of `prompt`, shared by the answers (at least 1
    /// each).
    ///
    /// ```
    /// use embedding_gateway::api::ChatRequest;
    ///
    /// let chat = |extra: &str| {
    ///     let body = format!(r#"{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}]{extra}}}"#);
    ///     ChatRequest::parse(body.as_bytes()).unwrap()
    /// };
    /// assert_eq!(chat(r#", "max_tokens": 50"#).completion_reserve(9, None, 512), 50);
    /// assert_eq!(chat(r#", "max_tokens": 50, "n": 3"#).completion_reserve(9, None, 512), 150);
    /// assert_eq!(chat(r#", "n": 2"#).completion_reserve(9, Some(100), 512), 200);
    /// assert_eq!(chat(r#", "n": 2"#).completion_reserve(12, None, 512), 500);
    ///
    /// let none = br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 0}"#;
    /// assert_eq!(ChatRequest::parse(none).unwrap_err().param, Some("n"));
    /// ```
    #[must_use]
    pub fn completion_reserve(&self, prompt: u64, default: Option<u64>, max_request_tokens: u64) -> u64 {
        let each = self
            .max_tokens
            .or(default)
            .unwrap_or_else(|| (max_request_tokens.saturating_sub(prompt) / self.choices).max(1));
        each.saturating_mul(self.choices)
    }
}

/// A streamed body fed by a channel: each `Bytes` sent is one data frame; the body ends
/// when every sender is dropped. Dropping the body tells the sender (its sends fail).
#[derive(Debug)]
pub struct ChannelBody(pub tokio::sync::mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(|b| Ok(http_body::Frame::data(b))))
    }
}

/// One `data:` event of a chat completion stream.
#[must_use]
pub fn sse_event(json: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {json}\n\n"))
}

/// The event that ends a chat completion stream.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_the_tail_or_else_from_the_whole() {
        let tail = br#"{"data": [not json], "model": "usage", "usage" : {"prompt_tokens": 4, "total_tokens": 4}}"#;
        assert_eq!(usage_total(tail), Some(4));
        let first = br#"{"usage": {"prompt_tokens": 2, "total_tokens": 2}, "data": [], "model": "usage"}"#;
        assert_eq!(usage_total(first), Some(2));
        assert_eq!(usage_total(br#"{"data": [], "note": "no \"usage\" here"}"#), None);
        assert_eq!(usage_total(b""), None);
    }
}
