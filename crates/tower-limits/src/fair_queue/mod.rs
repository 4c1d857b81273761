//! Weighted-fair tenant queue as a Tower layer. Work in progress.
