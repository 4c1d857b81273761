//! Redis backend for tower-limits. Work in progress.
