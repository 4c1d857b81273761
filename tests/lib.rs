//! Shared support for the integration tests in `tests/tests/`.
