//! Tenant keys: who a request is, tier by tier.
//!
//! A [`TenantKey`] is an ordered path of identifiers, one per tier, from the broadest to
//! the narrowest: `["acme", "engineering", "alice", "agent-1"]` for the tiers
//! `org > team > user > agent`. A limit scoped to a tier is keyed by the path up to and
//! including that tier, so `alice` in one team and `alice` in another are different
//! users, and a limit on `agent` never confuses two users' `agent-1`.
//!
//! A part is text, a number or an IP address ([`KeyPart`]). Numbers and addresses are
//! kept as their bytes, never as text: building a key from a client's address or a user's
//! numeric id formats nothing, and a limit's table keeps a numeric id in eight bytes.
//!
//! The path is stored once, joined, so every tier's key is a prefix of one byte string:
//! looking a tier up allocates nothing. A path of up to 39 bytes (an address, a number,
//! most tenant paths) is stored inside the key itself: building one allocates nothing,
//! and cloning it is a copy, touching no shared reference count (which every core would
//! otherwise write). Longer paths are shared behind a reference count.
//!
//! # The joined path
//!
//! Parts are joined by the byte `0x1F` (U+001F, which text parts may not contain). A
//! text part is its UTF-8 bytes; a number or an address is the byte `0xFF` (which UTF-8
//! never contains), a byte naming its kind, then its bytes in a fixed length: eight for
//! a number, four or sixteen for an address. Reading left to right, every joined path
//! splits into its parts one way only, so two keys share a tier's state exactly when
//! their parts up to that tier are equal, kind included.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use arrayvec::ArrayVec;

/// The most tiers a key can have.
pub const MAX_TIERS: usize = 8;

/// Separates parts inside the joined path; text parts may not contain it.
const SEPARATOR: char = '\u{1f}';

/// Opens a part kept as its bytes (a number or an address); never a byte of UTF-8.
const TYPED: u8 = 0xFF;
/// The kinds of a typed part, the byte after [`TYPED`].
const NUMBER: u8 = b'n';
const IPV4: u8 = b'4';
const IPV6: u8 = b'6';

/// One identifier of a [`TenantKey`]: text, a number or an IP address.
///
/// A part of one kind never equals a part of another, even when they print alike:
/// `KeyPart::Number(42)` and `KeyPart::Text("42")` are different tenants.
///
/// ```
/// use std::net::IpAddr;
/// use tower_limits_core::{KeyPart, TenantKey};
///
/// let ip: IpAddr = "192.0.2.7".parse().unwrap();
/// let key = TenantKey::from_parts([KeyPart::Text("acme"), KeyPart::Number(42), KeyPart::Ip(ip)]).unwrap();
/// assert_eq!(key.part(1), Some(KeyPart::Number(42)));
/// assert_eq!(key.to_string(), "acme/42/192.0.2.7");
/// assert_ne!(TenantKey::from_u64(42), TenantKey::single("42").unwrap());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyPart<'a> {
    /// An identifier as text.
    Text(&'a str),
    /// A numeric identifier, kept as its eight bytes.
    Number(u64),
    /// An IP address, kept as its four or sixteen bytes.
    Ip(IpAddr),
}

impl<'a> From<&'a str> for KeyPart<'a> {
    fn from(text: &'a str) -> Self {
        KeyPart::Text(text)
    }
}

impl From<u64> for KeyPart<'_> {
    fn from(n: u64) -> Self {
        KeyPart::Number(n)
    }
}

impl From<IpAddr> for KeyPart<'_> {
    fn from(ip: IpAddr) -> Self {
        KeyPart::Ip(ip)
    }
}

impl fmt::Display for KeyPart<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyPart::Text(text) => f.write_str(text),
            KeyPart::Number(n) => fmt::Display::fmt(n, f),
            KeyPart::Ip(ip) => fmt::Display::fmt(ip, f),
        }
    }
}

impl<'a> KeyPart<'a> {
    /// Reads the part whose joined bytes are `bytes` (see the module's notes).
    fn decode(bytes: &'a [u8]) -> Self {
        match bytes {
            [TYPED, NUMBER, rest @ ..] => KeyPart::Number(u64::from_be_bytes(array(rest))),
            [TYPED, IPV4, rest @ ..] => KeyPart::Ip(IpAddr::V4(Ipv4Addr::from(array::<4>(rest)))),
            [TYPED, IPV6, rest @ ..] => KeyPart::Ip(IpAddr::V6(Ipv6Addr::from(array::<16>(rest)))),
            // A text part was a `&str`'s bytes: they are its text again.
            text => KeyPart::Text(std::str::from_utf8(text).unwrap_or_default()),
        }
    }
}

/// The address a tier's joined prefix holds when it is that one IPv4 address alone.
#[inline(always)]
pub(crate) fn as_ipv4(prefix: &[u8]) -> Option<u32> {
    match *prefix {
        [TYPED, IPV4, a, b, c, d] => Some(u32::from_be_bytes([a, b, c, d])),
        _ => None,
    }
}

/// The length of the path of a key that is one number: marker, kind, eight bytes.
pub(crate) const NUMBER_PATH: usize = 10;

/// The number a tier's joined prefix holds when it is that one number alone.
#[inline(always)]
pub(crate) fn as_number(prefix: &[u8]) -> Option<u64> {
    match prefix {
        [TYPED, NUMBER, rest @ ..] => <[u8; 8]>::try_from(rest).ok().map(u64::from_be_bytes),
        _ => None,
    }
}

/// A number or an address as a joined path holds it: the marker, its kind, its bytes.
#[derive(Clone, Copy)]
pub(crate) struct Typed {
    bytes: [u8; 18],
    len: usize,
}

impl Typed {
    #[inline]
    fn new(kind: u8, payload: &[u8]) -> Self {
        let mut bytes = [0u8; 18];
        bytes[0] = TYPED;
        bytes[1] = kind;
        bytes[2..2 + payload.len()].copy_from_slice(payload);
        Typed { bytes, len: 2 + payload.len() }
    }

    /// The number `n`: also the whole prefix of a key that is that one number.
    #[inline]
    pub(crate) fn number(n: u64) -> Self {
        Self::new(NUMBER, &n.to_be_bytes())
    }

    #[inline]
    fn ip(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self::new(IPV4, &v4.octets()),
            IpAddr::V6(v6) => Self::new(IPV6, &v6.octets()),
        }
    }

    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// The first `N` bytes of `bytes`, zero-padded (a typed part always has them all).
fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    let n = bytes.len().min(N);
    out[..n].copy_from_slice(&bytes[..n]);
    out
}

/// An ordered path of identifiers, one per tier, broadest first.
///
/// ```
/// use tower_limits_core::{KeyPart, TenantKey};
///
/// let key = TenantKey::new(["acme", "engineering", "alice"]).unwrap();
/// assert_eq!(key.depth(), 3);
/// assert_eq!(key.part(1), Some(KeyPart::Text("engineering")));
/// assert_eq!(key.to_string(), "acme/engineering/alice");
/// ```
///
/// The global key holds nothing; any other key its joined path (inline when short) and
/// the offsets of its tiers, so that finding a tier's key is a slice, not a search.
#[derive(Clone, Default)]
pub struct TenantKey {
    /// The parts joined by the separator.
    path: Path,
    /// `ends.get(i)` is the byte length of the path up to and including part `i`.
    ends: Ends,
    depth: u8,
}

/// Where each part of a key's path ends: [`MAX_TIERS`] lengths of 16 bits, packed in one
/// integer. As an array of `u16` they were zeroed with overlapping stores around the
/// first length, which a copy of the key then read back across: a load that spans two
/// stores cannot be forwarded, a stall of some fifteen cycles on every key made per
/// request. An integer is written and copied in whole words.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
struct Ends(u128);

const _: () = assert!(MAX_TIERS * 16 <= 128, "the ends fit in one u128");

impl Ends {
    /// The ends of a key of one part `len` bytes long (at most [`INLINE`]).
    #[inline(always)]
    const fn first(len: usize) -> Ends {
        Ends(len as u128)
    }

    /// The end of part `i`.
    #[inline]
    fn get(self, i: usize) -> usize {
        usize::from((self.0 >> (16 * i)) as u16)
    }

    /// Sets the end of part `i`, unset so far.
    #[inline]
    fn set(&mut self, i: usize, end: u16) {
        self.0 |= u128::from(end) << (16 * i);
    }
}

/// The most bytes a path keeps inline: the longest text of an IPv6 address.
const INLINE: usize = 39;

#[derive(Clone, Default)]
enum Path {
    /// The key with no tier.
    #[default]
    Global,
    /// A short path, kept in the key itself.
    Inline(ArrayVec<u8, INLINE>),
    Shared(Arc<[u8]>),
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
        TenantKey { path: Path::Global, ends: Ends(0), depth: 0 }
    }

    /// A key of one tier: an IP address, kept as its bytes, for limits per client
    /// address. Builds without formatting or allocating.
    ///
    /// ```
    /// use std::net::IpAddr;
    /// use tower_limits_core::{KeyPart, TenantKey};
    ///
    /// let ip: IpAddr = "2001:db8::7".parse().unwrap();
    /// let key = TenantKey::from_ip(ip);
    /// assert_eq!(key.part(0), Some(KeyPart::Ip(ip)));
    /// assert_eq!(key.to_string(), "2001:db8::7");
    /// // An address is not its text: the two are different tenants.
    /// assert_ne!(key, TenantKey::single("2001:db8::7").unwrap());
    /// ```
    #[must_use]
    #[inline]
    pub fn from_ip(ip: IpAddr) -> Self {
        // One arm per family, so that each copies a length known where it is compiled.
        match ip {
            IpAddr::V4(v4) => Self::one_typed(Typed::new(IPV4, &v4.octets()).as_bytes()),
            IpAddr::V6(v6) => Self::one_typed(Typed::new(IPV6, &v6.octets()).as_bytes()),
        }
    }

    /// A key of one tier: a numeric id, kept as its eight bytes. Builds without
    /// formatting or allocating; a keyed table keeps it in eight bytes.
    ///
    /// ```
    /// use tower_limits_core::{KeyPart, TenantKey};
    ///
    /// let key = TenantKey::from_u64(1_000_042);
    /// assert_eq!(key.part(0), Some(KeyPart::Number(1_000_042)));
    /// assert_eq!(key.to_string(), "1000042");
    /// ```
    #[must_use]
    #[inline]
    pub fn from_u64(id: u64) -> Self {
        Self::one_typed(Typed::number(id).as_bytes())
    }

    /// A key of one typed part, whose encoding is `bytes` (at most 18 of them).
    #[inline]
    fn one_typed(bytes: &[u8]) -> Self {
        let mut path = ArrayVec::new();
        // At most 18 bytes into 39: this cannot fail.
        let _ = path.try_extend_from_slice(bytes);
        TenantKey { path: Path::Inline(path), ends: Ends::first(bytes.len()), depth: 1 }
    }

    /// A key of one tier.
    ///
    /// # Errors
    /// See [`TenantKey::new`].
    #[inline]
    pub fn single(id: impl AsRef<str>) -> Result<Self, KeyError> {
        Self::one_text(id.as_ref())
    }

    /// A key of one text part, written in place when it fits inline: a key made per
    /// request (from a header, say) costs a scan and a copy.
    #[inline]
    fn one_text(text: &str) -> Result<Self, KeyError> {
        let bytes = text.as_bytes();
        if bytes.len() > INLINE || bytes.contains(&(SEPARATOR as u8)) {
            // On the heap, or refused: the general builder says which.
            return Self::new([text]);
        }
        let mut path = ArrayVec::new();
        // Checked above: it fits.
        let _ = path.try_extend_from_slice(bytes);
        Ok(TenantKey { path: Path::Inline(path), ends: Ends::first(bytes.len()), depth: 1 })
    }

    /// A key from its text parts, broadest tier first.
    ///
    /// # Errors
    /// More than [`MAX_TIERS`] parts, a part containing U+001F, or a path longer than
    /// 65,535 bytes.
    pub fn new<I>(parts: I) -> Result<Self, KeyError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut key = Builder::default();
        for part in parts {
            key.push(KeyPart::Text(part.as_ref()))?;
        }
        Ok(key.finish())
    }

    /// A key from parts of any kind, broadest tier first: an organisation's name over a
    /// user's numeric id, say.
    ///
    /// ```
    /// use tower_limits_core::{KeyPart, TenantKey};
    ///
    /// let key = TenantKey::from_parts([KeyPart::Text("acme"), KeyPart::Number(7)]).unwrap();
    /// assert_eq!(key.parts().collect::<Vec<_>>(), [KeyPart::Text("acme"), KeyPart::Number(7)]);
    /// ```
    ///
    /// # Errors
    /// As [`TenantKey::new`].
    pub fn from_parts<'a, I>(parts: I) -> Result<Self, KeyError>
    where
        I: IntoIterator<Item = KeyPart<'a>>,
    {
        let mut key = Builder::default();
        for part in parts {
            key.push(part)?;
        }
        Ok(key.finish())
    }

    /// The whole joined path (`None` for the global key).
    #[inline]
    fn full(&self) -> Option<&[u8]> {
        match &self.path {
            Path::Global => None,
            Path::Inline(bytes) => Some(bytes.as_slice()),
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
    pub fn part(&self, i: usize) -> Option<KeyPart<'_>> {
        let path = self.full()?;
        if i >= self.depth() {
            return None;
        }
        let start = if i == 0 { 0 } else { self.ends.get(i - 1) + SEPARATOR.len_utf8() };
        Some(KeyPart::decode(&path[start..self.ends.get(i)]))
    }

    /// The parts, broadest first.
    pub fn parts(&self) -> impl Iterator<Item = KeyPart<'_>> + '_ {
        (0..self.depth()).filter_map(|i| self.part(i))
    }

    /// The joined bytes of the first `tiers` parts: what a limit scoped to tier
    /// `tiers - 1` keeps its state by. Two keys' prefixes are equal exactly when their
    /// first `tiers` parts are. `None` if the key is not that deep.
    ///
    /// ```
    /// use tower_limits_core::TenantKey;
    ///
    /// let alice = TenantKey::new(["acme", "alice"]).unwrap();
    /// let bob = TenantKey::new(["acme", "bob"]).unwrap();
    /// assert_eq!(alice.prefix(1), bob.prefix(1));
    /// assert_ne!(alice.prefix(2), bob.prefix(2));
    /// assert_eq!(alice.prefix(3), None);
    /// ```
    #[must_use]
    #[inline]
    pub fn prefix(&self, tiers: usize) -> Option<&[u8]> {
        match (tiers, self.full()) {
            (0, _) => Some(&[]),
            (n, Some(path)) if n <= self.depth() => Some(&path[..self.ends.get(n - 1)]),
            _ => None,
        }
    }

    /// Whether this is the key with no tier.
    #[must_use]
    #[inline]
    pub fn is_global(&self) -> bool {
        matches!(self.path, Path::Global)
    }
}

/// A key being built part by part: inline while it fits, on the heap from the first part
/// that does not.
#[derive(Default)]
struct Builder {
    inline: ArrayVec<u8, INLINE>,
    long: Option<Vec<u8>>,
    ends: Ends,
    depth: usize,
}

impl Builder {
    fn push(&mut self, part: KeyPart<'_>) -> Result<(), KeyError> {
        if self.depth == MAX_TIERS {
            return Err(KeyError::TooManyTiers(self.depth + 1));
        }
        let typed;
        let bytes: &[u8] = match part {
            KeyPart::Text(text) if text.contains(SEPARATOR) => return Err(KeyError::ReservedCharacter(self.depth)),
            KeyPart::Text(text) => text.as_bytes(),
            KeyPart::Number(n) => {
                typed = Typed::number(n);
                typed.as_bytes()
            }
            KeyPart::Ip(ip) => {
                typed = Typed::ip(ip);
                typed.as_bytes()
            }
        };
        let sep: &[u8] = if self.depth > 0 { &[SEPARATOR as u8] } else { &[] };
        if self.long.is_none() && self.inline.len() + sep.len() + bytes.len() > INLINE {
            self.long = Some(self.inline.to_vec());
        }
        let len = match &mut self.long {
            Some(path) => {
                path.extend_from_slice(sep);
                path.extend_from_slice(bytes);
                path.len()
            }
            None => {
                // Checked above: both fit.
                let _ = self.inline.try_extend_from_slice(sep);
                let _ = self.inline.try_extend_from_slice(bytes);
                self.inline.len()
            }
        };
        self.ends.set(self.depth, u16::try_from(len).map_err(|_| KeyError::TooLong)?);
        self.depth += 1;
        Ok(())
    }

    fn finish(self) -> TenantKey {
        let path = match self.long {
            _ if self.depth == 0 => Path::Global,
            Some(path) => Path::Shared(Arc::from(path)),
            None => Path::Inline(self.inline),
        };
        TenantKey { path, ends: self.ends, depth: self.depth as u8 }
    }
}

impl fmt::Display for TenantKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, part) in self.parts().enumerate() {
            if i > 0 {
                f.write_str("/")?;
            }
            fmt::Display::fmt(&part, f)?;
        }
        Ok(())
    }
}

impl fmt::Debug for TenantKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.parts()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Option<KeyPart<'_>> {
        Some(KeyPart::Text(s))
    }

    #[test]
    fn prefixes_are_tiers() {
        let k = TenantKey::new(["acme", "eng", "alice", "agent-1"]).unwrap();
        assert_eq!(k.prefix(0), Some(&b""[..]));
        assert_eq!(k.prefix(1), Some(&b"acme"[..]));
        assert_eq!(k.prefix(3), Some(&b"acme\x1feng\x1falice"[..]));
        assert_eq!(k.prefix(5), None);
        assert_eq!(k.parts().collect::<Vec<_>>(), ["acme", "eng", "alice", "agent-1"].map(KeyPart::Text));
        assert_eq!(k.part(0), text("acme"));
        assert_eq!(k.part(4), None);
        assert_eq!(TenantKey::global().part(0), None);
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
        assert_eq!(TenantKey::new(["ok", "a\u{1f}b"]), Err(KeyError::ReservedCharacter(1)));
        assert_eq!(TenantKey::new(["x"; 9]), Err(KeyError::TooManyTiers(9)));
        assert_eq!(TenantKey::from_parts([KeyPart::Number(1); 9]), Err(KeyError::TooManyTiers(9)));
        assert_eq!(TenantKey::new([&*"x".repeat(70_000)]), Err(KeyError::TooLong));
        assert_eq!(TenantKey::global().depth(), 0);
    }

    fn hash_of(key: &TenantKey) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut h);
        h.finish()
    }

    #[test]
    fn short_and_long_paths_behave_alike() {
        let long = "x".repeat(INLINE + 1);
        let (thirty, twenty) = ("a".repeat(30), "b".repeat(20));
        for parts in [
            vec!["acme", "alice"],
            vec![&long, "bob"],
            vec!["a"; MAX_TIERS],
            vec![&long[..INLINE]],
            vec![&long[..INLINE - 2], "y"],
            // Past the inline bound at the second part, then a third.
            vec![&thirty, &twenty, &twenty],
        ] {
            let key = TenantKey::new(&parts).unwrap();
            let joined = parts.iter().map(|p| p.len()).sum::<usize>() + parts.len() - 1;
            let inline = matches!(key.path, Path::Inline(_));
            assert_eq!(inline, joined <= INLINE, "{parts:?}: inline exactly when the path fits");
            assert_eq!(key.parts().collect::<Vec<_>>(), parts.iter().map(|p| KeyPart::Text(p)).collect::<Vec<_>>());
            assert_eq!(key, key.clone());
            assert_eq!(key.prefix(1), Some(parts[0].as_bytes()));
            assert_eq!(hash_of(&key), hash_of(&TenantKey::new(&parts).unwrap()));
        }
        assert_ne!(TenantKey::new(["ab"]).unwrap(), TenantKey::new(["a", "b"]).unwrap());
        assert_ne!(TenantKey::single("").unwrap(), TenantKey::global());
        assert!(TenantKey::global().is_global());
        assert!(!TenantKey::single("").unwrap().is_global());
    }

    /// `single` writes a one-part key in place; it is the very key `new` builds from
    /// the one part, inline exactly when it fits, and refuses what `new` refuses.
    #[test]
    fn a_single_key_is_the_key_of_its_one_part() {
        let long = "x".repeat(INLINE + 1);
        let wide = "\u{e9}".repeat(20); // 40 bytes of two-byte characters
        for text in ["", "a", "acme", &long[..INLINE - 1], &long[..INLINE], &long, &wide, "a\u{1f}b", "\u{1f}"] {
            let (one, general) = (TenantKey::single(text), TenantKey::new([text]));
            assert_eq!(format!("{:?}", one.as_ref().err()), format!("{:?}", general.as_ref().err()), "{text:?}");
            let (Ok(one), Ok(general)) = (one, general) else { continue };
            assert_eq!(one, general, "{text:?}");
            assert_eq!(hash_of(&one), hash_of(&general));
            assert_eq!(matches!(one.path, Path::Inline(_)), text.len() <= INLINE, "{text:?}: inline when it fits");
            assert_eq!((one.depth(), one.prefix(1)), (1, Some(text.as_bytes())));
            assert_eq!(one.part(0), Some(KeyPart::Text(text)));
        }
    }

    #[test]
    fn different_keys_hash_apart() {
        let keys = [
            TenantKey::global(),
            TenantKey::single("").unwrap(),
            TenantKey::single("a").unwrap(),
            TenantKey::new(["a", "b"]).unwrap(),
            TenantKey::from_u64(7),
            TenantKey::single("7").unwrap(),
        ];
        let hashes: std::collections::HashSet<u64> = keys.iter().map(hash_of).collect();
        assert_eq!(hashes.len(), keys.len());
    }

    #[test]
    fn a_key_of_no_parts_is_the_global_key() {
        let none = TenantKey::new(Vec::<&str>::new()).unwrap();
        assert!(none.is_global());
        assert_eq!(none, TenantKey::global());
        assert_eq!(format!("{none:?}"), "[]");
    }

    #[test]
    fn a_key_prints_its_parts() {
        let key = TenantKey::from_parts([KeyPart::Text("acme"), KeyPart::Number(7)]).unwrap();
        assert_eq!(format!("{key:?}"), r#"[Text("acme"), Number(7)]"#);
        assert_eq!(key.to_string(), "acme/7");
    }

    #[test]
    fn key_errors_say_what_is_wrong() {
        assert_eq!(KeyError::TooManyTiers(9).to_string(), "a tenant key has at most 8 tiers, got 9");
        assert!(KeyError::ReservedCharacter(2).to_string().contains("part 2"));
        assert!(KeyError::TooLong.to_string().contains("65535 bytes"));
    }

    /// Parts of every kind, including the numbers and addresses whose bytes hold the
    /// separator or the typed marker.
    fn assorted() -> Vec<KeyPart<'static>> {
        let mut parts = vec![KeyPart::Text(""), KeyPart::Text("a"), KeyPart::Text("42"), KeyPart::Text("10.0.0.1")];
        for n in [0, 1, 0x1f, 0xff, 0x1f1f, u64::MAX, u64::MAX - 1, 42, 0x1f00_0000_0000_00ff] {
            parts.push(KeyPart::Number(n));
        }
        for ip in ["0.0.0.0", "31.31.31.31", "255.255.255.255", "10.0.0.1", "::", "::1", "1f1f::ffff", "::ffff:1.2.3.4"]
        {
            parts.push(KeyPart::Ip(ip.parse().unwrap()));
        }
        parts
    }

    #[test]
    fn typed_parts_come_back_as_they_went_in() {
        let parts = assorted();
        for a in &parts {
            for b in &parts {
                for c in &parts {
                    let key = TenantKey::from_parts([*a, *b, *c]).unwrap();
                    assert_eq!(key.parts().collect::<Vec<_>>(), [*a, *b, *c]);
                    assert_eq!(key.to_string(), format!("{a}/{b}/{c}"));
                }
            }
        }
    }

    #[test]
    fn keys_share_a_prefix_only_when_their_parts_are_equal() {
        let parts = assorted();
        let mut keys = Vec::new();
        for a in &parts {
            keys.push(TenantKey::from_parts([*a]).unwrap());
            for b in &parts {
                keys.push(TenantKey::from_parts([*a, *b]).unwrap());
            }
        }
        for x in &keys {
            for y in &keys {
                let same = x.parts().eq(y.parts());
                assert_eq!(x == y, same, "{x:?} {y:?}");
                assert_eq!(x.prefix(x.depth()) == y.prefix(y.depth()), same, "{x:?} {y:?}");
            }
        }
    }

    #[test]
    fn ip_and_number_keys_are_their_bytes() {
        for text in [
            "0.0.0.0",
            "9.10.100.255",
            "192.0.2.7",
            "255.255.255.255",
            "::",
            "::1",
            "2001:db8::7",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "::ffff:192.0.2.1",
        ] {
            let ip: IpAddr = text.parse().unwrap();
            let key = TenantKey::from_ip(ip);
            assert_eq!(key.to_string(), ip.to_string());
            assert_eq!(key.part(0), Some(KeyPart::Ip(ip)));
            assert_eq!(key, TenantKey::from_parts([KeyPart::Ip(ip)]).unwrap());
            assert_ne!(key, TenantKey::single(ip.to_string()).unwrap());
            assert!(matches!(key.path, Path::Inline(_)));
        }
        for n in [0, 7, 1 << 40, u64::MAX] {
            let key = TenantKey::from_u64(n);
            assert_eq!(key.part(0), Some(KeyPart::Number(n)));
            assert_eq!(key, TenantKey::from_parts([KeyPart::Number(n)]).unwrap());
            assert_eq!(key.prefix(1).map(<[u8]>::len), Some(10));
            assert_ne!(key, TenantKey::single(n.to_string()).unwrap());
        }
        assert_ne!(TenantKey::from_u64(0x0a00_0001), TenantKey::from_ip(IpAddr::from([10, 0, 0, 1])));
    }
}
