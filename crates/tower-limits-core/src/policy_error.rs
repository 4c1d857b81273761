//! The error of a limit that does not make sense: which field, and what is wrong with it.
//!
//! A leaf module: the algorithms, rates and policies all report through it, and it
//! depends on none of them.

use std::fmt;

/// A policy that does not make sense, with the field that says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    field: String,
    message: String,
}

impl PolicyError {
    /// An error about `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        PolicyError { field: field.into(), message: message.into() }
    }

    /// The path of the offending field, such as `limits[2] (tokens-per-minute).burst`.
    #[must_use]
    pub fn field(&self) -> &str {
        &self.field
    }

    /// What is wrong with it.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error, with `prefix` put before the field path.
    #[must_use]
    pub fn within(mut self, prefix: &str) -> Self {
        self.field = if self.field.is_empty() { prefix.to_owned() } else { format!("{prefix}.{}", self.field) };
        self
    }
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() { f.write_str(&self.message) } else { write!(f, "{}: {}", self.field, self.message) }
    }
}

impl std::error::Error for PolicyError {}
