//! Tenant keys: who a request is, tier by tier.
//!
//! A [`TenantKey`] is an ordered path of identifiers, one per tier, from the broadest to
//! the narrowest: `["acme", "engineering", "alice", "agent-1"]` for the tiers
//! `org > team > user > agent`. A limit scoped to a tier is keyed by the path up to and
//! including that tier, so `alice` in one team and `alice` in another are different
//! users, and a limit on `agent` never confuses two users' `agent-1`.
//!
//! The path is stored once, joined, so every tier's key is a prefix of one string:
//! looking a tier up allocates nothing, and cloning a key is a reference count.

use std::fmt;
use std::sync::Arc;

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
/// The global key holds nothing; any other key one shared string and the offsets of its
/// tiers, so that finding a tier's key is a slice, not a search.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct TenantKey {
    /// The parts joined by the separator; `None` for the key with no tier.
    path: Option<Arc<str>>,
    /// `ends[i]` is the byte length of the path up to and including part `i`.
    ends: [u16; MAX_TIERS],
    depth: u8,
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
        TenantKey { path: None, ends: [0; MAX_TIERS], depth: 0 }
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
        let mut path = String::new();
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
            if depth > 0 {
                path.push(SEPARATOR);
            }
            path.push_str(part);
            ends[depth] = u16::try_from(path.len()).map_err(|_| KeyError::TooLong)?;
            depth += 1;
        }
        Ok(TenantKey { path: (depth > 0).then(|| Arc::from(path)), ends, depth: depth as u8 })
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
        let path = self.path.as_deref()?;
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
        match (tiers, self.path.as_deref()) {
            (0, _) => Some(""),
            (n, Some(path)) if n <= self.depth() => Some(&path[..usize::from(self.ends[n - 1])]),
            _ => None,
        }
    }

    /// Whether this is the key with no tier.
    #[must_use]
    #[inline]
    pub fn is_global(&self) -> bool {
        self.path.is_none()
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
}
