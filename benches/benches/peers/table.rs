//! The harness: a row of the table, the interleaved rounds that fill it (per call or
//! throughput on threads), and the table printed from the rows.

use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

/// Rounds of every row.
pub(crate) const ROUNDS: usize = 9;
/// Wall time one side of one round aims for.
const SLICE: Duration = Duration::from_millis(40);

/// Nanoseconds per call of `op`, over about `SLICE`.
fn per_call(op: &mut dyn FnMut()) -> f64 {
    // Calibrate the batch once, then time it.
    let mut n = 1_000u64;
    loop {
        let start = StdInstant::now();
        for _ in 0..n {
            op();
        }
        let took = start.elapsed();
        if took >= SLICE / 8 {
            let n = (n as f64 * SLICE.as_secs_f64() / took.as_secs_f64()) as u64;
            let start = StdInstant::now();
            for _ in 0..n {
                op();
            }
            return start.elapsed().as_nanos() as f64 / n as f64;
        }
        n *= 4;
    }
}

/// Total operations per second of `threads` threads running `op` for about `SLICE`.
fn throughput(threads: usize, op: Op) -> f64 {
    let per_thread = {
        // One thread's pace sizes the batch.
        let op = op.clone();
        let ns = per_call(&mut || op());
        (SLICE.as_nanos() as f64 / ns) as u64
    };
    let elapsed = tower_limits_benches::on_threads(threads, per_thread, op);
    (per_thread * threads as u64) as f64 / elapsed.as_secs_f64()
}

/// An operation each thread of [`throughput`] runs.
pub(crate) type Op = Arc<dyn Fn() + Send + Sync>;

/// The thread counts of the threaded rows: 2, and every core's when there are more.
pub(crate) fn thread_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    if cores > 2 { vec![2, cores] } else { vec![2] }
}

/// Fills `row` with [`ROUNDS`] rounds of two throughputs in Mop/s, ours on `ours.0`
/// threads and theirs on `theirs.0`, each side first in every other round.
pub(crate) fn throughput_rounds(row: &mut Row, ours: (usize, &Op), theirs: (usize, &Op)) {
    for round in 0..ROUNDS {
        if round % 2 == 0 {
            row.ours.push(throughput(ours.0, ours.1.clone()) / 1e6);
            row.theirs.push(throughput(theirs.0, theirs.1.clone()) / 1e6);
        } else {
            row.theirs.push(throughput(theirs.0, theirs.1.clone()) / 1e6);
            row.ours.push(throughput(ours.0, ours.1.clone()) / 1e6);
        }
    }
}

/// One row of the table: our side's and the peer's figure in every round.
pub(crate) struct Row {
    name: String,
    pub(crate) ours: Vec<f64>,
    pub(crate) theirs: Vec<f64>,
    unit: &'static str,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl Row {
    /// A row with no rounds yet.
    pub(crate) fn new(name: impl Into<String>, unit: &'static str) -> Row {
        Row { name: name.into(), ours: Vec::new(), theirs: Vec::new(), unit }
    }

    /// A side's throughput on more threads (`more`, Mop/s) over its own on one, round by
    /// round.
    pub(crate) fn scaling(name: String, more: &[f64], one: &[f64]) -> Row {
        Row { name, ours: more.to_vec(), theirs: one.to_vec(), unit: "Mop/s" }
    }

    fn print(&self) {
        let ratios: Vec<f64> = self.ours.iter().zip(&self.theirs).map(|(o, t)| o / t).collect();
        let mut sorted = ratios.clone();
        sorted.sort_by(f64::total_cmp);
        println!(
            "| {:<44} | {:>12.2} | {:>12.2} | {:>5} | {:>6.2}x | {:.2} / {:.2} / {:.2} |",
            self.name,
            median(&self.ours),
            median(&self.theirs),
            self.unit,
            median(&self.ours) / median(&self.theirs),
            sorted[0],
            median(&ratios),
            sorted[sorted.len() - 1],
        );
    }
}

/// Times `ours` and `theirs` per call, interleaved over the rounds.
pub(crate) fn pair(name: &str, ours: &mut dyn FnMut(), theirs: &mut dyn FnMut()) -> Row {
    let mut row = Row::new(name, "ns");
    for round in 0..ROUNDS {
        if round % 2 == 0 {
            row.ours.push(per_call(ours));
            row.theirs.push(per_call(theirs));
        } else {
            row.theirs.push(per_call(theirs));
            row.ours.push(per_call(ours));
        }
    }
    row
}

/// The overhead of two middlewares over the same bare service and request: each round
/// times the bare service, ours and theirs (in turn), and keeps ours - bare and theirs -
/// bare.
pub(crate) fn overhead(name: &str, bare: &mut dyn FnMut(), ours: &mut dyn FnMut(), theirs: &mut dyn FnMut()) -> Row {
    let mut row = Row::new(name, "ns");
    for round in 0..ROUNDS {
        let (o, t, b) = if round % 2 == 0 {
            let b = per_call(bare);
            (per_call(ours), per_call(theirs), b)
        } else {
            let t = per_call(theirs);
            let o = per_call(ours);
            (o, t, per_call(bare))
        };
        // A floor keeps a ratio meaningful when a middleware costs about nothing.
        row.ours.push((o - b).max(0.5));
        row.theirs.push((t - b).max(0.5));
    }
    row
}

/// Prints the table of `rows`, under its heading and over its notes.
pub(crate) fn print(rows: &[Row]) {
    println!();
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    println!(
        "peers: tower-limits against governor, tower_governor, tower::limit; {ROUNDS} interleaved rounds, {cores} cores"
    );
    println!();
    println!(
        "| {:<44} | {:>12} | {:>12} | {:>5} | {:>7} | per-round ratio min / med / max |",
        "path", "ours (med)", "peer (med)", "unit", "ratio"
    );
    println!("|{:-<46}|{:-<14}|{:-<14}|{:-<7}|{:-<9}|{:-<33}|", "", "", "", "", "", "");
    for row in rows {
        row.print();
    }
    println!();
    println!("ns rows: ratio below 1.0 is faster than the peer. Mop/s rows: above 1.0 is more throughput.");
    println!("tower rows: overhead over the same bare `service_fn` and request, measured in the same round.");
}
