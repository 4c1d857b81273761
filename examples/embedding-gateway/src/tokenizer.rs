//! A small deterministic tokenizer: what a request costs, known before the call.
//!
//! Embedding providers charge by tokens of their own tokenizer; a gateway needs the count
//! *before* it sends the request, to charge the tenant's tokens-per-minute and the
//! upstream account's mirror. This one is simple and stable, so that the estimate, the
//! mock upstream's `usage` and the tests agree:
//!
//! - whitespace is free;
//! - a run of letters and digits (any script) costs one token per started four
//!   characters (`"embedding"` is 9 characters: 3 tokens);
//! - every other character (punctuation, symbols, emoji) is one token.
//!
//! So `"Hello, world!"` is `Hello` (2) `,` (1) `world` (2) `!` (1): 6 tokens. A real
//! deployment would count with the provider's tokenizer or an upper bound of it: the
//! estimate must never be below what the provider will count, or the mirror would
//! under-charge; the gateway settles to the provider's reported usage afterwards, so an
//! over-estimate costs nothing once the answer is in.

/// Characters per token in a run of letters and digits.
const CHARS_PER_TOKEN: usize = 4;

/// The number of tokens in `text`.
///
/// ```
/// use embedding_gateway::tokenizer::count;
///
/// assert_eq!(count("Hello, world!"), 6);
/// assert_eq!(count("  "), 0);
/// assert_eq!(count("embedding"), 3);
/// ```
#[must_use]
pub fn count(text: &str) -> u64 {
    let mut tokens = 0u64;
    let mut run = 0usize;
    for c in text.chars() {
        if c.is_alphanumeric() {
            run += 1;
            continue;
        }
        tokens += run.div_ceil(CHARS_PER_TOKEN) as u64;
        run = 0;
        if !c.is_whitespace() {
            tokens += 1;
        }
    }
    tokens + run.div_ceil(CHARS_PER_TOKEN) as u64
}

/// The tokens of every input of a request.
#[must_use]
pub fn count_all<S: AsRef<str>>(inputs: &[S]) -> u64 {
    inputs.iter().map(|s| count(s.as_ref())).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts() {
        assert_eq!(count(""), 0);
        assert_eq!(count("a"), 1);
        assert_eq!(count("abcd"), 1);
        assert_eq!(count("abcde"), 2);
        assert_eq!(count("a b c"), 3);
        assert_eq!(count("naïve café"), 2 + 1);
        assert_eq!(count("x+y=z"), 5);
        assert_eq!(count_all(&["a b", "cd."]), 4);
    }
}
