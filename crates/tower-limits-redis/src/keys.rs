//! Key layout: where each limit's state lives, and which Cluster slot that is.
//!
//! Every key of a set for one tenant carries the same *hash tag* (the part between the
//! first `{` and the next `}`), so Redis Cluster puts them in one slot and the set's
//! script can touch them all in one call:
//!
//! ```text
//! <namespace>:{<root>}[/<part>...]:<limit>:<kind>     a limit keyed by a tier
//! <namespace>:{*}:<limit>:<kind>                      a global limit (per-tenant layout)
//! <namespace>:{<tag>}:<root>[/<part>...]:<limit>:<kind>   one-slot layout, keyed
//! <namespace>:{<tag>}:*:<limit>:<kind>                one-slot layout, global
//! ```
//!
//! `<root>` is the tenant key's broadest tier and `<part>`s the narrower ones down to the
//! limit's tier: `tl:{acme}/alice:requests:g` is the GCRA state of user `alice` of org
//! `acme`. `<kind>` is the state's shape (`g` GCRA and token bucket, `f` fixed window,
//! `c` sliding-window counter, `l` sliding-window log, `s` semaphore counting requests,
//! `w` semaphore counting cost), so a limit whose algorithm changes never reads a state
//! of another shape.
//!
//! Tenant ids and limit names are escaped: every byte other than ASCII letters, digits
//! and `-_.~@+` is written `%XX`, so a tenant id can never close the hash tag early
//! (`{`, `}`), forge a separator (`:`, `/`), or collide with the global tag `*`; an
//! empty id is written `%`. A part that is a number or an IP address
//! ([`KeyPart`](tower_limits_core::KeyPart)) is written `#` and then its text, escaped
//! alike: `#42`, `#192.0.2.7`, `#2001%3Adb8%3A%3A1`. An id's own `#` is escaped, so the
//! number `42` and the text id `"42"` are different tenants here as in memory.

use std::fmt::{self, Write};

use tower_limits_core::KeyPart;

/// How a set's keys are spread over Redis Cluster slots.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum SlotLayout {
    /// Each tenant's keys share the slot of its root (the broadest tier): tenants spread
    /// over the cluster. Global limits live in the slot of `{*}`, so on a cluster a set
    /// that mixes global and keyed limits is refused when it is built (see
    /// [`BuildError::CrossSlot`](crate::BuildError::CrossSlot)).
    #[default]
    PerTenant,
    /// Every key of the set shares the slot of this tag: global and keyed limits together,
    /// atomic in one script, at the price of one slot (one node) carrying the whole set.
    OneSlot(String),
}

/// Appends `s` escaped for use in a key.
pub(crate) fn escape_into(out: &mut String, s: &str) {
    if s.is_empty() {
        out.push('%');
    } else {
        escape_bytes(out, s);
    }
}

/// Appends one part of a tenant key escaped for use in a key: text as [`escape_into`],
/// a number or an address as `#` and its text, escaped, written without a heap copy.
pub(crate) fn escape_part_into(out: &mut String, part: KeyPart<'_>) {
    match part {
        KeyPart::Text(text) => escape_into(out, text),
        typed => {
            out.push('#');
            // Writing into a `String` cannot fail.
            let _ = write!(Escaped(out), "{typed}");
        }
    }
}

fn escape_bytes(out: &mut String, s: &str) {
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'@' | b'+') {
            out.push(char::from(b));
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 15)]));
        }
    }
}

/// Escapes what is written through it.
struct Escaped<'a>(&'a mut String);

impl fmt::Write for Escaped<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        escape_bytes(self.0, s);
        Ok(())
    }
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag, or of the whole key
/// when it has none, modulo 16384. The same rule as `CLUSTER KEYSLOT`.
///
/// ```
/// use tower_limits_redis::key_slot;
///
/// assert_eq!(key_slot("tl:{acme}/alice:requests:g"), key_slot("tl:{acme}:tokens:g"));
/// assert_eq!(key_slot("123456789"), 12739);
/// ```
#[must_use]
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &bytes[open + 1..];
        rest.iter().position(|&b| b == b'}').filter(|&close| close > 0).map(|close| &rest[..close])
    });
    crc16(tagged.unwrap_or(bytes)) % 16384
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn esc(s: &str) -> String {
        let mut out = String::new();
        escape_into(&mut out, s);
        out
    }

    #[test]
    fn escaping_keeps_tags_closed() {
        assert_eq!(esc("acme"), "acme");
        assert_eq!(esc("a{b}c"), "a%7Bb%7Dc");
        assert_eq!(esc("a:b/c*"), "a%3Ab%2Fc%2A");
        assert_eq!(esc("100%"), "100%25");
        assert_eq!(esc(""), "%");
        assert_eq!(esc("é"), "%C3%A9");
    }

    #[test]
    fn numbers_and_addresses_are_marked_apart_from_text() {
        let part = |p: KeyPart<'_>| {
            let mut out = String::new();
            escape_part_into(&mut out, p);
            out
        };
        assert_eq!(part(KeyPart::Number(42)), "#42");
        assert_eq!(part(KeyPart::Text("42")), "42");
        assert_eq!(part(KeyPart::Text("#42")), "%2342");
        assert_eq!(part(KeyPart::Text("")), "%");
        assert_eq!(part(KeyPart::Ip("192.0.2.7".parse().unwrap())), "#192.0.2.7");
        assert_eq!(part(KeyPart::Ip("2001:db8::1".parse().unwrap())), "#2001%3Adb8%3A%3A1");
    }

    #[test]
    fn slots_follow_hash_tags() {
        assert_eq!(key_slot("123456789"), 12739);
        assert_eq!(key_slot("{user1000}.following"), key_slot("{user1000}.followers"));
        // An empty tag hashes the whole key.
        assert_eq!(key_slot("foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
        assert_eq!(key_slot("foo{{bar}}zap"), crc16(b"{bar") % 16384);
    }
}
