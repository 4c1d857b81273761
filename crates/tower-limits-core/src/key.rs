//! Tenant keys: who a request is, tier by tier.
//!
//! A [`TenantKey`] is an ordered path of identifiers, one per tier, from the broadest to
//! the narrowest: `["acme", "engineering", "alice", "agent-1"]` for the tiers
//! `org > team > user > agent`. A limit scoped to a tier is keyed by the path up to and
//! including that tier, so `alice` in one team and `alice` in another are different
//! users, and a limit on `agent` never confuses two users' `agent-1`.
//!
//! The path is stored once, joined, so every tier's key is a prefix of one string:
//! looking a tier up allocates nothing. A path of up to 39 bytes (an IP address in any
//! form, most tenant paths) is stored inside the key itself: building one allocates
//! nothing, and cloning it is a copy, touching no shared reference count (which every
//! core would otherwise write). Longer paths are shared behind a reference count.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::Arc;

use arrayvec::ArrayString;

/// The most tiers a key can have.
pub const MAX_TIERS: usize = 8;

/// Separates parts inside the joined path; parts may not contain it.
const SEPARATOR: char = '\u{1f}';

/// An ordered path of identifiers, one per tier, broadest first.
///
/// ```
/// use tower_limits_core::TenantKey;
///
/// let key = TenantKey::new(["acme", "engineering", "alice"]).unwrap();
/// assert_eq!(key.depth(), 3);
/// assert_eq!(key.part(1), Some("engineering"));
/// assert_eq!(key.to_string(), "acme/engineering/alice");
/// ```
///
/// The global key holds nothing; any other key its joined path (inline when short) and
/// the offsets of its tiers, so that finding a tier's key is a slice, not a search.
#[derive(Clone, Default)]
pub struct TenantKey {
    /// The parts joined by the separator.
    path: Path,
    /// `ends[i]` is the byte length of the path up to and including part `i`.
    ends: [u16; MAX_TIERS],
    depth: u8,
}

/// The most bytes a path keeps inline: the longest text of an IPv6 address.
const INLINE: usize = 39;

#[derive(Clone, Default)]
enum Path {
    /// The key with no tier.
    #[default]
    Global,
    /// A short path, kept in the key itself.
    Inline(ArrayString<INLINE>),
    Shared(Arc<str>),
}

impl PartialEq for TenantKey {
    fn eq(&self, other: &Self) -> bool {
        self.depth == other.depth && self.ends == other.ends && self.full() == other.full()
    }
}

impl Eq for TenantKey {}

impl Hash for TenantKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.depth.hash(state);
        self.full().hash(state);
    }
}

/// Why a [`TenantKey`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// More parts than [`MAX_TIERS`].
    TooManyTiers(usize),
    /// A part contains the reserved separator character U+001F.
    ReservedCharacter(usize),
    /// The joined path is longer than 65,535 bytes.
    TooLong,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::TooManyTiers(n) => write!(f, "a tenant key has at most {MAX_TIERS} tiers, got {n}"),
            KeyError::ReservedCharacter(i) => {
                write!(f, "part {i} of the tenant key contains the reserved character U+001F")
            }
            KeyError::TooLong => f.write_str("a tenant key is at most 65535 bytes long"),
        }
    }
}

impl std::error::Error for KeyError {}

impl TenantKey {
    /// The key with no tier: what global limits use. Costs nothing to build or clone.
    #[must_use]
    pub const fn global() -> Self {
        TenantKey { path: Path::Global, ends: [0; MAX_TIERS], depth: 0 }
    }

    /// A key of one tier: an IP address, as text (`192.0.2.7`, `2001:db8::1`). Builds
    /// without allocating, for limits per client address.
    ///
    /// ```
    /// use std::net::IpAddr;
    /// use tower_limits_core::TenantKey;
    ///
    /// let ip: IpAddr = "2001:db8::7".parse().unwrap();
    /// assert_eq!(TenantKey::from_ip(ip).to_string(), "2001:db8::7");
    /// assert_eq!(TenantKey::from_ip(ip), TenantKey::single("2001:db8::7").unwrap());
    /// ```
    #[must_use]
    pub fn from_ip(ip: IpAddr) -> Self {
        let mut text = ArrayString::<INLINE>::new();
        match ip {
            IpAddr::V4(v4) => write_ipv4(&mut text, v4.octets()),
            // An IPv6 address is at most 39 bytes of text: the write cannot fail.
            IpAddr::V6(v6) => drop(fmt::write(&mut text, format_args!("{v6}"))),
        }
        let mut ends = [0u16; MAX_TIERS];
        ends[0] = text.len() as u16;
        TenantKey { path: Path::Inline(text), ends, depth: 1 }
    }

    /// A key of one tier.
    ///
    /// # Errors
    /// See [`TenantKey::new`].
    pub fn single(id: impl AsRef<str>) -> Result<Self, KeyError> {
        Self::new([id])
    }

    /// A key from its parts, broadest tier first.
    ///
    /// # Errors
    /// More than [`MAX_TIERS`] parts, a part containing U+001F, or a path longer than
    /// 65,535 bytes.
    pub fn new<I>(parts: I) -> Result<Self, KeyError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        // Built inline while it fits, on the heap from the first part that does not.
        let mut inline = ArrayString::<INLINE>::new();
        let mut long: Option<String> = None;
        let mut ends = [0u16; MAX_TIERS];
        let mut depth = 0usize;
        for part in parts {
            let part = part.as_ref();
            if depth == MAX_TIERS {
                return Err(KeyError::TooManyTiers(depth + 1));
            }
            if part.contains(SEPARATOR) {
                return Err(KeyError::ReservedCharacter(depth));
            }
            let sep = if depth > 0 { SEPARATOR.len_utf8() } else { 0 };
            if long.is_none() && inline.len() + sep + part.len() > INLINE {
                long = Some(String::from(inline.as_str()));
            }
            let len = match &mut long {
                Some(path) => {
                    if sep > 0 {
                        path.push(SEPARATOR);
                    }
                    path.push_str(part);
                    path.len()
                }
                None => {
                    if sep > 0 {
                        inline.push(SEPARATOR);
                    }
                    inline.push_str(part);
                    inline.len()
                }
            };
            ends[depth] = u16::try_from(len).map_err(|_| KeyError::TooLong)?;
            depth += 1;
        }
        let path = match long {
            _ if depth == 0 => Path::Global,
            Some(path) => Path::Shared(Arc::from(path)),
            None => Path::Inline(inline),
        };
        Ok(TenantKey { path, ends, depth: depth as u8 })
    }

    /// The whole joined path (`None` for the global key).
    #[inline]
    fn full(&self) -> Option<&str> {
        match &self.path {
            Path::Global => None,
            Path::Inline(text) => Some(text.as_str()),
            Path::Shared(path) => Some(path),
        }
    }

    /// How many tiers the key has.
    #[must_use]
    #[inline]
    pub fn depth(&self) -> usize {
        usize::from(self.depth)
    }

    /// The identifier at tier `i`, if the key is that deep.
    #[must_use]
    pub fn part(&self, i: usize) -> Option<&str> {
        let path = self.full()?;
        if i >= self.depth() {
            return None;
        }
        let start = if i == 0 { 0 } else { usize::from(self.ends[i - 1]) + SEPARATOR.len_utf8() };
        Some(&path[start..usize::from(self.ends[i])])
    }

    /// The parts, broadest first.
    pub fn parts(&self) -> impl Iterator<Item = &str> + '_ {
        (0..self.depth()).filter_map(|i| self.part(i))
    }

    /// The joined path of the first `tiers` parts: the key of a limit scoped to tier
    /// `tiers - 1`. `None` if the key is not that deep.
    #[must_use]
    #[inline]
    pub fn prefix(&self, tiers: usize) -> Option<&str> {
        match (tiers, self.full()) {
            (0, _) => Some(""),
            (n, Some(path)) if n <= self.depth() => Some(&path[..usize::from(self.ends[n - 1])]),
            _ => None,
        }
    }

    /// Whether this is the key with no tier.
    #[must_use]
    #[inline]
    pub fn is_global(&self) -> bool {
        matches!(self.path, Path::Global)
    }

    /// The first part: the broadest tier, which decides where the key's state lives.
    #[must_use]
    #[inline]
    pub fn root(&self) -> &str {
        self.prefix(1).unwrap_or("")
    }
}

impl fmt::Display for TenantKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, part) in self.parts().enumerate() {
            if i > 0 {
                f.write_str("/")?;
            }
            f.write_str(part)?;
        }
        Ok(())
    }
}

impl fmt::Debug for TenantKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.parts()).finish()
    }
}

/// Writes an IPv4 address as dotted decimal (at most 15 bytes), without the formatting
/// machinery.
fn write_ipv4(out: &mut ArrayString<INLINE>, octets: [u8; 4]) {
    for (i, octet) in octets.into_iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        if octet >= 100 {
            out.push(char::from(b'0' + octet / 100));
        }
        if octet >= 10 {
            out.push(char::from(b'0' + (octet / 10) % 10));
        }
        out.push(char::from(b'0' + octet % 10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_tiers() {
        let k = TenantKey::new(["acme", "eng", "alice", "agent-1"]).unwrap();
        assert_eq!(k.prefix(0), Some(""));
        assert_eq!(k.prefix(1), Some("acme"));
        assert_eq!(k.prefix(3), Some("acme\u{1f}eng\u{1f}alice"));
        assert_eq!(k.prefix(5), None);
        assert_eq!(k.parts().collect::<Vec<_>>(), ["acme", "eng", "alice", "agent-1"]);
        assert_eq!(k.root(), "acme");
    }

    #[test]
    fn same_leaf_under_different_parents_differs() {
        let a = TenantKey::new(["acme", "alice"]).unwrap();
        let b = TenantKey::new(["globex", "alice"]).unwrap();
        assert_ne!(a.prefix(2), b.prefix(2));
    }

    #[test]
    fn bad_keys_are_errors() {
        assert_eq!(TenantKey::new(["a\u{1f}b"]), Err(KeyError::ReservedCharacter(0)));
        assert_eq!(TenantKey::new(["x"; 9]), Err(KeyError::TooManyTiers(9)));
        assert_eq!(TenantKey::new([&*"x".repeat(70_000)]), Err(KeyError::TooLong));
        assert_eq!(TenantKey::global().depth(), 0);
    }

    #[test]
    fn short_and_long_paths_behave_alike() {
        let long = "x".repeat(INLINE + 1);
        for parts in [vec!["acme", "alice"], vec![&long, "bob"], vec!["a"; MAX_TIERS], vec![&long[..INLINE]]] {
            let key = TenantKey::new(&parts).unwrap();
            assert_eq!(key.parts().collect::<Vec<_>>(), parts);
            assert_eq!(key, key.clone());
            assert_eq!(key.prefix(1), Some(parts[0]));
            let hashes = [&key, &TenantKey::new(&parts).unwrap()].map(|k| {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                k.hash(&mut h);
                h.finish()
            });
            assert_eq!(hashes[0], hashes[1]);
        }
        assert_ne!(TenantKey::new(["ab"]).unwrap(), TenantKey::new(["a", "b"]).unwrap());
        assert_ne!(TenantKey::single("").unwrap(), TenantKey::global());
    }

    #[test]
    fn ip_keys_are_their_text() {
        for text in [
            "0.0.0.0",
            "9.10.100.255",
            "192.0.2.7",
            "255.255.255.255",
            "100.99.10.9",
            "::",
            "::1",
            "2001:db8::7",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "::ffff:192.0.2.1",
        ] {
            let ip: IpAddr = text.parse().unwrap();
            let key = TenantKey::from_ip(ip);
            assert_eq!(key.to_string(), ip.to_string());
            assert_eq!(key, TenantKey::single(ip.to_string()).unwrap());
            assert_eq!(key.root(), ip.to_string());
        }
        // Every octet value, in every position.
        for n in 0..=255u8 {
            let ip = IpAddr::from([n, 255 - n, n / 2, n.wrapping_mul(7)]);
            assert_eq!(TenantKey::from_ip(ip).to_string(), ip.to_string());
        }
    }
}
