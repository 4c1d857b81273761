//! The estimate law: over a corpus of several scripts, code, numbers, emoji, long
//! repetitive text and token arrays, the gateway's count of a request is never below the
//! provider's encoding's, and equal to it for embeddings. The provider's count is taken
//! from a second, independent implementation of OpenAI's encodings (`tiktoken-rs`, a
//! port of OpenAI's own tokenizer), so that the gateway's (`bpe-openai`) is checked, not
//! restated.

use embedding_gateway::api::{ChatRequest, EmbeddingRequest};
use embedding_gateway::tokenizer::Encoding;
use proptest::prelude::*;
use tiktoken_rs::{ChatCompletionRequestMessage, CoreBPE, FunctionCall};

/// Texts a provider meets, chosen where a quarter of the characters is far from the
/// count: scripts whose characters are several tokens each, digits cut in threes, emoji
/// of many code points, code's whitespace.
fn corpus() -> Vec<String> {
    let fixed = [
        "The quick brown fox jumps over the lazy dog.",
        "Rate limits keep a shared API fair: requests per minute, tokens per minute.",
        "Größenordnung, Straßenbahn, Übermäßig – naïve café, déjà vu, señor, smørrebrød.",
        "Съешь же ещё этих мягких французских булок, да выпей чаю.",
        "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
        "نص عربي للتجربة: الحد من المعدل يحمي الخدمة المشتركة.",
        "טקסט בעברית לבדיקה של ספירת אסימונים.",
        "यह टोकन गिनती की जाँच के लिए हिंदी पाठ है।",
        "速率限制保护共享的服务。每分钟的请求数和令牌数。",
        "レート制限は共有サービスを守ります。トークンを数えましょう。",
        "속도 제한은 공유 서비스를 보호합니다. 토큰을 셉니다.",
        "การจำกัดอัตราช่วยปกป้องบริการที่ใช้ร่วมกัน",
        "Emoji: 😀😃😄 👩‍👩‍👧‍👦 👍🏽 🇩🇪🇯🇵🇺🇸 ❤️‍🔥 🧑🏿‍🚀",
        "fn main() {\n    let v: Vec<u64> = (0..10).map(|x| x * x).collect();\n    println!(\"{v:?}\");\n}\n",
        "def f(x):\n\tif x > 0:\n\t\treturn x ** 2\n\treturn -x  # negative\n",
        "{\"id\": 12345, \"tags\": [\"a\", \"b\"], \"nested\": {\"ok\": true, \"ratio\": 0.125}}",
        "3.14159265358979323846264338327950288419716939937510 1234567890 +49 (30) 123-4567",
        "2026-11-28T13:28:11Z 0xDEADBEEF 1e-9 -0.0 100,000,000.00 $1,234.56 €9.99",
        "https://example.com/v1/embeddings?model=text-embedding-3-small&dims=256#frag",
        "SGVsbG8sIHdvcmxkISBUaGlzIGlzIGJhc2U2NCBlbmNvZGVkIHRleHQgZm9yIHRva2Vucy4=",
        "   leading and trailing spaces   \n\n\n\r\n\t\t mixed   whitespace \u{a0}\u{2003} ",
        "MiXeD CaSe WoRdS and ALLCAPS and lowercase, it's we're they've I'm you'll he'd",
        "<|endoftext|> is only text here, and so is <|im_start|>",
        "\u{0}\u{1}\u{7f} control characters and a lone combining mark: e\u{301} a\u{308}",
    ];
    let mut texts: Vec<String> = fixed.iter().map(|s| (*s).to_owned()).collect();
    // Long repetitive text: the runs a BPE merges, and those it cannot.
    texts.push("a".repeat(10_000));
    texts.push("ab ".repeat(3_000));
    texts.push("\n".repeat(1_000));
    texts.push(" ".repeat(5_000));
    texts.push("1".repeat(4_000));
    texts.push("🙂".repeat(500));
    texts.push("速".repeat(2_000));
    texts.push(fixed[0].repeat(200));
    texts
}

/// The provider's count of `text`: OpenAI's encoding, by the second implementation,
/// with special tokens' text read as ordinary text, as the API reads a request.
fn reference(encoding: Encoding) -> &'static CoreBPE {
    match encoding {
        Encoding::Cl100kBase => tiktoken_rs::cl100k_base_singleton(),
        Encoding::O200kBase => tiktoken_rs::o200k_base_singleton(),
        Encoding::Utf8Bytes => unreachable!("no provider counts so"),
    }
}

fn provider_count(encoding: Encoding, text: &str) -> u64 {
    reference(encoding).encode_ordinary(text).len() as u64
}

const EXACT: [Encoding; 2] = [Encoding::Cl100kBase, Encoding::O200kBase];

#[test]
fn each_text_counts_as_the_provider_counts_it_and_bytes_bound_it() {
    let texts = corpus();
    for text in &texts {
        for encoding in EXACT {
            let n = provider_count(encoding, text);
            let head: String = text.chars().take(24).collect();
            assert_eq!(encoding.count(text), n, "{encoding} of {head:?}");
            assert_eq!(encoding.count_within(text, n), Some(n), "{encoding} within its count, {head:?}");
            if n > 0 {
                assert_eq!(encoding.count_within(text, n - 1), None, "{encoding} one below, {head:?}");
            }
            assert!(Encoding::Utf8Bytes.count(text) >= n, "bytes bound {encoding} of {head:?}");
        }
    }
    // The corpus bites: a quarter of the characters, the old estimate, is below the
    // provider's count for a good part of it.
    let under = texts.iter().filter(|t| Encoding::Cl100kBase.count(t) > (t.chars().count() as u64).div_ceil(4)).count();
    assert!(under >= 10, "only {under} texts count more than a quarter of their characters");
}

#[test]
fn embeddings_are_charged_exactly_in_every_input_form() {
    let texts = corpus();
    for encoding in EXACT {
        let each: Vec<u64> = texts.iter().map(|t| provider_count(encoding, t)).collect();
        let total: u64 = each.iter().sum();
        let parse = |input: serde_json::Value| {
            EmbeddingRequest::parse(serde_json::json!({ "model": "m", "input": input }).to_string().as_bytes()).unwrap()
        };
        // One string, then all of them as an array.
        for (text, n) in texts.iter().zip(&each) {
            assert_eq!(parse(serde_json::json!(text)).tokens(encoding), *n);
        }
        let all = parse(serde_json::json!(texts));
        assert_eq!(all.tokens(encoding), total, "{encoding}: an array of strings");
        assert_eq!(all.tokens_within(encoding, total), Some(total));
        assert_eq!(all.tokens_within(encoding, total - 1), None);
        // Token ids: the provider's own tokens of each text, one token each.
        let ids: Vec<Vec<u32>> = texts.iter().map(|t| reference(encoding).encode_ordinary(t)).collect();
        assert_eq!(parse(serde_json::json!(ids[0])).tokens(encoding), each[0], "{encoding}: one token array");
        assert_eq!(parse(serde_json::json!(ids)).tokens(encoding), total, "{encoding}: arrays of token ids");
    }
}

#[test]
fn chat_prompts_are_never_charged_below_the_provider_and_exactly_without_tools() {
    let texts = corpus();
    for (encoding, model) in [(Encoding::Cl100kBase, "gpt-4"), (Encoding::O200kBase, "gpt-4o")] {
        for (i, pair) in texts.chunks(2).enumerate() {
            let roles = ["system", "user", "assistant", "user"];
            let mut ours = Vec::new();
            let mut theirs = Vec::new();
            for (j, text) in pair.iter().enumerate() {
                let role = roles[(i + j) % roles.len()];
                let name = (j == 1).then(|| format!("agent_{i}"));
                ours.push(serde_json::json!({ "role": role, "content": text, "name": name }));
                theirs.push(message(role, Some(text), name, Vec::new()));
            }
            let body = serde_json::json!({ "model": model, "messages": ours }).to_string();
            let request = ChatRequest::parse(body.as_bytes()).unwrap();
            let expected = tiktoken_rs::num_tokens_from_messages(model, &theirs).unwrap() as u64;
            let charged = request.prompt_tokens(encoding);
            assert!(charged >= expected, "{model}, messages {i}: {charged} < {expected}");
            // Equal, but where the text spells a special token: that reference counts
            // it as the one special token, the gateway as the text it is (more).
            if !pair.iter().any(|t| t.contains("<|")) {
                assert_eq!(charged, expected, "{model}, messages {i}");
            }
        }
        // An assistant's tool call: its JSON text is counted, more than the provider's
        // rendering of it.
        let arguments = "{\"city\": \"Zürich\", \"days\": 3}";
        let body = serde_json::json!({
            "model": model,
            "messages": [
                { "role": "user", "content": "Weather in Zürich?" },
                { "role": "assistant", "content": null, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": { "name": "forecast", "arguments": arguments },
                }]},
            ],
        })
        .to_string();
        let request = ChatRequest::parse(body.as_bytes()).unwrap();
        let call = FunctionCall { name: "forecast".into(), arguments: arguments.into() };
        let theirs = [
            message("user", Some("Weather in Zürich?"), None, Vec::new()),
            message("assistant", None, None, vec![call]),
        ];
        let provider = tiktoken_rs::num_tokens_from_messages(model, &theirs).unwrap() as u64;
        assert!(request.prompt_tokens(encoding) >= provider, "{model}: tool calls");
    }
}

fn message(
    role: &str,
    content: Option<&str>,
    name: Option<String>,
    tool_calls: Vec<FunctionCall>,
) -> ChatCompletionRequestMessage {
    ChatCompletionRequestMessage {
        role: role.into(),
        content: content.map(Into::into),
        name,
        function_call: None,
        tool_calls,
        refusal: None,
    }
}

/// Characters from every corner of the corpus, to mix at random.
fn mixed_text() -> impl Strategy<Value = String> {
    let pieces = prop::sample::select(vec![
        "a",
        "the",
        " ",
        "  ",
        "\n",
        "\t",
        "\r\n",
        "7",
        "42",
        "1234",
        ".",
        ",",
        "'s",
        "'LL",
        "é",
        "ß",
        "ж",
        "λ",
        "ع",
        "ש",
        "ह",
        "速",
        "レ",
        "속",
        "ก",
        "😀",
        "👍🏽",
        "👩‍👩‍👧",
        "🇯🇵",
        "\u{301}",
        "{",
        "}",
        "()",
        "=>",
        "::",
        "<|",
        "|>",
    ]);
    prop::collection::vec(pieces, 0..200).prop_map(|p| p.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random mixes count exactly, stop exactly at a limit, and stay within their bytes.
    #[test]
    fn random_texts_count_as_the_provider_counts_them(text in mixed_text(), cut in 0u64..400) {
        for encoding in EXACT {
            let n = provider_count(encoding, &text);
            prop_assert_eq!(encoding.count(&text), n);
            prop_assert_eq!(encoding.count_within(&text, cut), Some(n).filter(|&n| n <= cut));
            prop_assert!(Encoding::Utf8Bytes.count(&text) >= n);
        }
    }
}
