//! Weighted-fair tenant queue (start-time fair queuing). Work in progress.
