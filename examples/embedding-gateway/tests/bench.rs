//! `embedding-gateway bench`, spawned tiny (1 round of 1 s, 2 connections): it starts
//! its children, drives every target, exits 0 and prints its table and ratios. The
//! figures themselves are not checked (no wall-clock thresholds): only the structure.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_embedding-gateway");

#[test]
fn a_tiny_bench_prints_its_table_and_ratios() {
    let out =
        Command::new(BIN).args(["bench", "--rounds", "1", "--seconds", "1", "--connections", "2"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);
    for expected in [
        "target",
        "req/s min/med/max",
        "CPU µs/req min/med/max",
        "p50 µs min/med/max",
        "p99 µs min/med/max",
        "upstream µs/req",
        "ratios of medians:",
        "CPU per request      gateway / hop",
        "added p50 latency    gateway / hop",
        "answers were 200",
    ] {
        assert!(stdout.contains(expected), "no {expected:?} in:\n{stdout}");
    }
    for target in ["direct", "hop", "gateway"] {
        assert!(stdout.lines().any(|l| l.starts_with(target)), "no row for {target} in:\n{stdout}");
    }
    // nginx is measured when it is installed, and said to be skipped when it is not.
    assert!(stdout.lines().any(|l| l.starts_with("nginx")), "nginx neither measured nor skipped:\n{stdout}");
}

#[test]
fn hop_needs_an_upstream() {
    let out = Command::new(BIN).arg("hop").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("hop needs --upstream URL"));
}
