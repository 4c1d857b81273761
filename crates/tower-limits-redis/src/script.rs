//! The Lua script of a limit set: how one round trip decides every limit.
//!
//! # One script per set
//!
//! A set's script is generated once, when the backend is built, from its policy. The
//! acquisition is written out limit by limit with the limits' parameters as constants:
//! no table of limits, no dispatch on the algorithm, no function created per call except
//! the helpers of the sliding windows, when the set has one. (Redis runs a script's
//! whole text on every call, so every closure and table it builds costs every call.)
//! Settle and renew, rarer, follow as generic code over a table of the limits. Redis
//! caches the script by its SHA1; every call is an `EVALSHA`, and a `NOSCRIPT` answer
//! (the cache was flushed, or a failover promoted a replica that never saw the script)
//! is followed by one `EVAL` of the full text, which caches it again.
//!
//! `KEYS` are the set's keys for one tenant, one per limit in the order of the policy.
//! `ARGV[1]` selects the operation:
//!
//! - `a`, acquire (then the cost, and the grant's holder id when a semaphore or a log
//!   records it): read the server's `TIME` once, load every limit's state, check every
//!   limit **without writing** (but for pruning a full semaphore's expired leases, which
//!   count as free either way), and only if all pass commit all of them. The reply is a
//!   flat array of integers: `granted, now_us, now_sub, blocking index, retry_after_ns,
//!   needs_release`, then `remaining, reset_ns` for every limit (after the grant, or as
//!   they stand on a refusal).
//! - `b`, acquire like `a`, but a grant answers only `1, now_us, now_sub`: what the
//!   backend sends when no peek cache keeps the states. A refusal answers in full.
//! - `s`, settle: correct the limits that count cost from the charged cost to the real
//!   one (a charge or a refund), and optionally release the grant's semaphore holds.
//!   Cancel is a settle to zero with a release.
//! - `n`, renew: push the grant's semaphore lease deadlines to `now + lease`.
//! - `r`, release (then the holder id and the cost acquired): what `s` does with a
//!   release and no correction, written out first in the script so that it runs before
//!   the clock is read and the settle's tables and helpers are built (a release costs the
//!   server about a third of what it did through `s`). A set whose one semaphore counts
//!   requests never sends it: its release is a plain `ZREM` of the grant's member
//!   `holder:1`, all this operation would do, without the cost of calling a script (some
//!   1.5 us of the server's CPU against 0.1 us for the command).
//!
//! # Time and exact integers
//!
//! Redis runs Lua 5.1, whose only numbers are doubles: integers are exact below 2^53,
//! and a division floors exactly below 2^52.
//! Absolute times are therefore kept as whole microseconds (the resolution of `TIME`;
//! about 1.8e15 today) plus a sub-microsecond part in nanoseconds that is zero unless a
//! test drives the clock. Everything the algorithms compare is a *difference* from now in
//! nanoseconds, which stays below 2^52 (52 days) because the builder refuses longer
//! windows and tolerances. The one product that can exceed that, in the sliding-window
//! counter, goes through `muldiv`, an exact `floor(a*b/c)` by doubling. Numbers that go
//! back to Redis as arguments are either passed as numbers (`redis.call` writes them
//! with `%.17g`, exact below 2^53) or formatted with `%.0f`, never through Lua's
//! `tostring` or `..`, which would round them to 14 digits.
//!
//! # State per limit
//!
//! | kind | Redis type | value |
//! |---|---|---|
//! | GCRA, token bucket | string | the theoretical arrival time: whole microseconds since the epoch of the server clock, then `.nnn` nanoseconds when they are not zero (never with the server's clock and an interval of whole microseconds) |
//! | fixed window | string | `window_start_us:count` |
//! | sliding-window counter | string | `window_start_us:previous:current` |
//! | sliding-window log | sorted set | one member `at_us.at_sub:cost:holder` per grant, scored by `at_us`; member `=` scored `-(sum+1)` |
//! | semaphore counting requests | sorted set | one member `holder:1` per grant, scored by its lease deadline (us); the count is the set's cardinality: expired leases are pruned by one grant in eight, and always before a refusal (a refusal counts live leases only) |
//! | calendar window | string | `period_start_us:period_end_us:count`, the period as the acquiring replica's clock placed it (see below) |
//! | semaphore counting cost | sorted set | one member `holder:weight` per grant, scored by its lease deadline (us); member `=` scored `-(held+1)` |
//!
//! Every key carries an expiry at the instant its state becomes indistinguishable from
//! a fresh one (plus 2 ms), so an idle tenant leaves nothing behind.

use std::fmt::Write as _;

/// How a limit is evaluated in the script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScriptLimit {
    /// GCRA or token bucket (the same decisions): interval and tolerance in ns.
    Gcra { cost: bool, interval: u64, tolerance: u64 },
    /// Fixed window: limit, window in us.
    Fixed { cost: bool, limit: u64, window_us: u64 },
    /// Sliding-window counter: limit, window in us.
    Counter { cost: bool, limit: u64, window_us: u64 },
    /// Sliding-window log: limit, window in us.
    Log { cost: bool, limit: u64, window_us: u64 },
    /// Semaphore: capacity. Counting requests, each hold weighs one and the count is the
    /// set's cardinality; counting cost, holds carry their weight and member `=` the sum.
    Semaphore { cost: bool, capacity: u64 },
    /// Calendar window: limit; the bounds of the current period come with each
    /// acquisition, as the `slot`-th pair of arguments after the holder id.
    Calendar { cost: bool, limit: u64, slot: usize },
}

impl ScriptLimit {
    /// The character that ends the limit's keys: the shape of its state.
    pub(crate) fn kind(&self) -> char {
        match self {
            ScriptLimit::Gcra { .. } => 'g',
            ScriptLimit::Fixed { .. } => 'f',
            ScriptLimit::Counter { .. } => 'c',
            ScriptLimit::Log { .. } => 'l',
            ScriptLimit::Semaphore { cost: false, .. } => 's',
            ScriptLimit::Semaphore { cost: true, .. } => 'w',
            ScriptLimit::Calendar { .. } => 'k',
        }
    }
}

/// The script of one set: the acquisition written out limit by limit with the set's
/// constants, then the generic settle and renew operations.
pub(crate) fn generate(limits: &[ScriptLimit], lease_us: u64, manual_clock: bool) -> String {
    let slack_ms: u64 = if manual_clock { 3_600_000 } else { 0 };
    let mut s = String::with_capacity(8192);
    s.push_str("-- tower-limits-redis: the limit script of one set (see the crate docs)\n");
    s.push_str("local call, floor, fmt, match, sub, tonumber, byte = redis.call, math.floor, string.format, string.match, string.sub, tonumber, string.byte\n");
    // The release first: it needs neither the clock nor the tables and helpers below,
    // which the server would otherwise build on every call.
    release_branch(&mut s, limits);
    if manual_clock {
        // Test-only: the caller's clock, and expiries an hour longer so that keys never
        // expire in real time before they are idle in the test's time.
        s.push_str("local NOW_US, NOW_SUB = tonumber(ARGV[2]), tonumber(ARGV[3])\n");
    } else {
        s.push_str("local T = call('TIME')\nlocal NOW_US, NOW_SUB = T[1] * 1000000 + T[2], 0\n");
    }
    let _ = writeln!(s, "local SLACK_MS, LEASE_US, CALENDAR_KEEP_MS = {slack_ms}, {lease_us}, {CALENDAR_KEEP_MS}");
    let counter = limits.iter().any(|l| matches!(l, ScriptLimit::Counter { .. }));
    let log = limits.iter().any(|l| matches!(l, ScriptLimit::Log { .. }));
    let semaphore = limits.iter().any(|l| matches!(l, ScriptLimit::Semaphore { .. }));
    s.push_str("if ARGV[1] == 'a' or ARGV[1] == 'b' then\n");
    // The caller's time comes first with the test clock; the holder id only when a
    // semaphore or a log records it.
    let first = if manual_clock { 4 } else { 2 };
    let needs_cost = limits.iter().any(|l| match *l {
        ScriptLimit::Gcra { cost, .. }
        | ScriptLimit::Fixed { cost, .. }
        | ScriptLimit::Counter { cost, .. }
        | ScriptLimit::Log { cost, .. }
        | ScriptLimit::Semaphore { cost, .. }
        | ScriptLimit::Calendar { cost, .. } => cost,
    });
    if needs_cost {
        let _ = writeln!(s, "  local cost, uid = tonumber(ARGV[{first}]), ARGV[{}]", first + 1);
    } else {
        let _ = writeln!(s, "  local uid = ARGV[{}]", first + 1);
    }
    s.push_str("  local blocked, retry, release = 0, 0, 0\n");
    if counter {
        s.push_str(MULDIV);
        s.push_str(COUNTER);
    }
    if log {
        s.push_str(LOG);
    }
    if semaphore {
        // Numbers, not strings: `redis.call` writes a number exactly (`%.17g`), and a
        // `string.format` per call costs the server more than the conversion.
        s.push_str("  local NOWS, DEADLINE = NOW_US, NOW_US + LEASE_US\n");
    }
    let lease_ttl = lease_us / 1000 + 1002 + slack_ms;
    // Load and check, writing nothing.
    for (n, l) in limits.iter().enumerate() {
        check_limit(&mut s, n + 1, l, first);
    }
    // Commit all, only if all passed.
    s.push_str("  if blocked == 0 then\n");
    for (n, l) in limits.iter().enumerate() {
        commit_limit(&mut s, n + 1, l, slack_ms, lease_ttl);
    }
    // A grant asked for briefly: the states are not read back (each integer of a reply
    // costs the server about as much as a fifth of a `GET`).
    s.push_str("    if ARGV[1] == 'b' then return {1, NOW_US, NOW_SUB} end\n  end\n");
    // Remaining and reset of every limit, as they stand now.
    for (n, l) in limits.iter().enumerate() {
        report_limit(&mut s, n + 1, l);
    }
    s.push_str("  return {blocked == 0 and 1 or 0, NOW_US, NOW_SUB, blocked > 0 and blocked - 1 or 0, retry, release");
    for i in 1..=limits.len() {
        let _ = write!(s, ", r{i}, s{i}");
    }
    s.push_str("}\nend\n");
    // Settle and renew: rarer, generic over a table of the limits.
    s.push_str("local L = {\n");
    for l in limits {
        table_row(&mut s, l);
    }
    s.push_str("}\n");
    s.push_str(MULDIV);
    s.push_str(SETTLE);
    s
}

/// Loads limit `i` (1-based, its key `KEYS[i]`) and checks it, writing nothing: a limit
/// that does not pass raises `blocked` and `retry`.
fn check_limit(s: &mut String, i: usize, l: &ScriptLimit, first: usize) {
    let _ = writeln!(s, "  -- limit {i}");
    let _ = match *l {
        ScriptLimit::Gcra { cost, interval, tolerance } => write!(
            s,
            "  local k{i}, d{i} = KEYS[{i}], 0
  do
    local v = call('GET', k{i})
    -- a theoretical arrival time well in the past is no debt: no need to read it exactly
    if v and tonumber(v) > NOW_US - 1000 then
      if byte(v, -4) == 46 then d{i} = (tonumber(sub(v, 1, -5)) - NOW_US) * 1000 + tonumber(sub(v, -3)) - NOW_SUB
      else d{i} = (tonumber(v) - NOW_US) * 1000 - NOW_SUB end
      if d{i} < 0 then d{i} = 0 end
    end
  end
  local n{i} = d{i} + {c} * {interval}
  if n{i} > {tolerance} then local r = n{i} - {tolerance}; if r >= retry then retry, blocked = r, {i} end end
",
            c = cost_of(cost)
        ),
        ScriptLimit::Fixed { cost, limit, window_us } => write!(
            s,
            "  local k{i}, w{i}, e{i}, u{i} = KEYS[{i}], 0, 0, 0
  do
    local v, st = call('GET', k{i}), 0
    if v then local a, b = match(v, '^(%d+):(%d+)$'); st, u{i} = tonumber(a), tonumber(b) end
    if st > NOW_US then w{i} = st else local r = NOW_US % {window_us}; w{i}, e{i} = NOW_US - r, r * 1000 + NOW_SUB end
    if w{i} ~= st then u{i} = 0 end
  end
  if u{i} + {c} > {limit} then local r = {w} - e{i}; if r >= retry then retry, blocked = r, {i} end end
",
            c = cost_of(cost),
            w = window_us * 1000
        ),
        ScriptLimit::Calendar { cost, limit, slot } => write!(
            s,
            "  local k{i}, w{i}, z{i}, u{i} = KEYS[{i}], tonumber(ARGV[{a}]), tonumber(ARGV[{b}]), 0
  do
    -- the stored period when it is this one or a later one (a replica whose clock is
    -- ahead crossed the boundary first); an earlier one has ended: nothing counted
    local v = call('GET', k{i})
    if v then
      local a, b, c = match(v, '^(%d+):(%d+):(%d+)$')
      a = tonumber(a)
      if a >= w{i} then w{i}, z{i}, u{i} = a, tonumber(b), tonumber(c) end
    end
  end
  if u{i} + {c} > {limit} then
    local r = (z{i} - NOW_US) * 1000 - NOW_SUB
    if r < 1 then r = 1 end
    if r >= retry then retry, blocked = r, {i} end
  end
",
            a = first + 2 + 2 * slot,
            b = first + 3 + 2 * slot,
            c = cost_of(cost),
        ),
        ScriptLimit::Counter { cost, limit, window_us } => write!(
            s,
            "  local k{i} = KEYS[{i}]
  local w{i}, e{i}, p{i}, u{i} = cview(call('GET', k{i}), {window_us})
  do local r = ccheck({limit}, {w}, p{i}, u{i}, e{i}, {c}); if r and r >= retry then retry, blocked = r, {i} end end
",
            c = cost_of(cost),
            w = window_us * 1000
        ),
        ScriptLimit::Log { cost, limit, window_us } => write!(
            s,
            "  local k{i} = KEYS[{i}]
  local l{i} = lload(k{i}, {window_us})
  do local r = lcheck(k{i}, l{i}, {limit}, {w}, {c}); if r and r >= retry then retry, blocked = r, {i} end end
",
            c = cost_of(cost),
            w = window_us * 1000
        ),
        ScriptLimit::Semaphore { cost: false, capacity } => write!(
            s,
            "  local k{i} = KEYS[{i}]
  local h{i} = call('ZCARD', k{i})
  if h{i} + 1 > {capacity} then
    call('ZREMRANGEBYSCORE', k{i}, 0, NOWS)
    h{i} = call('ZCARD', k{i})
    if h{i} + 1 > {capacity} then release = 1; if blocked == 0 then blocked = {i} end end
  end
"
        ),
        ScriptLimit::Semaphore { cost: true, capacity } => write!(
            s,
            "  local k{i}, h{i}, x{i} = KEYS[{i}], 0, false
  do
    local t = call('ZSCORE', k{i}, '=')
    if t then h{i} = -tonumber(t) - 1 end
    local ms = call('ZRANGEBYSCORE', k{i}, 0, NOWS)
    x{i} = #ms > 0
    for j = 1, #ms do h{i} = h{i} - tonumber(match(ms[j], ':(%d+)$')) end
  end
  if h{i} + cost > {capacity} then release = 1; if blocked == 0 then blocked = {i} end end
"
        ),
    };
}

/// Commits limit `i`, checked by [`check_limit`]: its new state, with an expiry of its
/// own (`slack_ms` longer with the test clock; `lease_ttl` for a semaphore's holds).
fn commit_limit(s: &mut String, i: usize, l: &ScriptLimit, slack_ms: u64, lease_ttl: u64) {
    let ttl = |ns: &str| format!("floor(({ns}) / 1000000) + {}", 2 + slack_ms);
    let _ = match *l {
        ScriptLimit::Gcra { .. } => write!(
            s,
            "    do
      local q = floor((NOW_SUB + n{i}) / 1000)
      local r = NOW_SUB + n{i} - q * 1000
      -- whole microseconds as a number (written exactly); a string only with nanoseconds
      if r == 0 then call('SET', k{i}, NOW_US + q, 'PX', {t})
      else call('SET', k{i}, fmt('%.0f.%03d', NOW_US + q, r), 'PX', {t}) end
      d{i} = n{i}
    end
",
            t = ttl(&format!("n{i}"))
        ),
        ScriptLimit::Fixed { cost, window_us, .. } => write!(
            s,
            "    u{i} = u{i} + {c}
    call('SET', k{i}, fmt('%.0f:%.0f', w{i}, u{i}), 'PX', {t})
",
            c = cost_of(cost),
            t = ttl(&format!("{} - e{i}", window_us * 1000))
        ),
        ScriptLimit::Calendar { cost, .. } => write!(
            s,
            "    u{i} = u{i} + {c}
    call('SET', k{i}, fmt('%.0f:%.0f:%.0f', w{i}, z{i}, u{i}), 'PX', floor((z{i} - NOW_US) / 1000) + {keep})
",
            c = cost_of(cost),
            keep = CALENDAR_KEEP_MS + slack_ms
        ),
        ScriptLimit::Counter { cost, window_us, .. } => write!(
            s,
            "    u{i} = u{i} + {c}
    call('SET', k{i}, fmt('%.0f:%.0f:%.0f', w{i}, p{i}, u{i}), 'PX', {t})
",
            c = cost_of(cost),
            t = ttl(&format!("{} - e{i}", 2 * window_us * 1000))
        ),
        ScriptLimit::Log { cost, window_us, .. } => {
            writeln!(s, "    lcommit(k{i}, l{i}, {}, uid, {})", cost_of(cost), window_us * 1000)
        }
        ScriptLimit::Semaphore { cost: false, .. } => write!(
            s,
            "    if NOW_US % 8 == 0 then call('ZREMRANGEBYSCORE', k{i}, 0, NOWS) end
    call('ZADD', k{i}, DEADLINE, uid .. ':1')
    call('PEXPIRE', k{i}, {lease_ttl})
    h{i} = h{i} + 1
"
        ),
        ScriptLimit::Semaphore { cost: true, .. } => write!(
            s,
            "    if x{i} then call('ZREMRANGEBYSCORE', k{i}, 0, NOWS) end
    if cost > 0 then call('ZADD', k{i}, DEADLINE, uid .. ':' .. fmt('%.0f', cost)) end
    h{i} = h{i} + cost
    call('ZADD', k{i}, fmt('%.0f', -h{i} - 1), '=')
    call('PEXPIRE', k{i}, {lease_ttl})
"
        ),
    };
}

/// What is left of limit `i` and when it resets, as it stands after the decision.
fn report_limit(s: &mut String, i: usize, l: &ScriptLimit) {
    let _ = match *l {
        ScriptLimit::Gcra { interval, tolerance, .. } => writeln!(
            s,
            "  local r{i}, s{i} = floor(({tolerance} - (d{i} < {tolerance} and d{i} or {tolerance})) / {interval}), d{i}"
        ),
        ScriptLimit::Fixed { limit, window_us, .. } => writeln!(
            s,
            "  local r{i}, s{i} = ({limit} > u{i} and {limit} - u{i} or 0), (u{i} > 0 and {} - e{i} or 0)",
            window_us * 1000
        ),
        ScriptLimit::Counter { limit, window_us, .. } => {
            writeln!(s, "  local r{i}, s{i} = cpeek({limit}, {}, p{i}, u{i}, e{i})", window_us * 1000)
        }
        ScriptLimit::Log { limit, window_us, .. } => {
            writeln!(s, "  local r{i}, s{i} = lpeek(k{i}, l{i}, {limit}, {})", window_us * 1000)
        }
        ScriptLimit::Semaphore { capacity, .. } => {
            writeln!(s, "  local r{i}, s{i} = ({capacity} > h{i} and {capacity} - h{i} or 0), 0")
        }
        ScriptLimit::Calendar { limit, .. } => writeln!(
            s,
            "  local r{i}, s{i} = ({limit} > u{i} and {limit} - u{i} or 0), (z{i} > NOW_US and (z{i} - NOW_US) * 1000 - NOW_SUB or 0)"
        ),
    };
}

/// The row of the settle and renew table that describes `l`.
fn table_row(s: &mut String, l: &ScriptLimit) {
    let _ = match *l {
        ScriptLimit::Gcra { cost, interval, tolerance } => {
            writeln!(s, "  {{1, {}, {interval}, {tolerance}}},", u8::from(cost))
        }
        ScriptLimit::Fixed { cost, limit, window_us } => {
            writeln!(s, "  {{2, {}, {limit}, {}, {window_us}}},", u8::from(cost), window_us * 1000)
        }
        ScriptLimit::Counter { cost, limit, window_us } => {
            writeln!(s, "  {{3, {}, {limit}, {}, {window_us}}},", u8::from(cost), window_us * 1000)
        }
        ScriptLimit::Log { cost, limit, window_us } => {
            writeln!(s, "  {{4, {}, {limit}, {}, {window_us}}},", u8::from(cost), window_us * 1000)
        }
        ScriptLimit::Semaphore { cost, capacity } => writeln!(s, "  {{5, {}, {capacity}}},", u8::from(cost)),
        ScriptLimit::Calendar { cost, limit, .. } => writeln!(s, "  {{6, {}, {limit}}},", u8::from(cost)),
    };
}

/// `r`, release (then the holder id and the cost acquired): the grant's semaphore holds
/// leave, as in a settle with a release, written out per semaphore of the set.
fn release_branch(s: &mut String, limits: &[ScriptLimit]) {
    s.push_str("if ARGV[1] == 'r' then\n  local uid, acq = ARGV[2], tonumber(ARGV[3])\n");
    for (n, l) in limits.iter().enumerate() {
        let i = n + 1;
        let _ = match *l {
            ScriptLimit::Semaphore { cost: false, .. } => writeln!(s, "  call('ZREM', KEYS[{i}], uid .. ':1')"),
            ScriptLimit::Semaphore { cost: true, .. } => write!(
                s,
                "  if acq > 0 and call('ZREM', KEYS[{i}], uid .. ':' .. fmt('%.0f', acq)) == 1 then
    local t = call('ZSCORE', KEYS[{i}], '=')
    local held = (t and (-tonumber(t) - 1) or 0) - acq
    if held < 0 then held = 0 end
    if held == 0 and call('ZCARD', KEYS[{i}]) == 1 then call('DEL', KEYS[{i}])
    else call('ZADD', KEYS[{i}], fmt('%.0f', -held - 1), '=') end
  end
"
            ),
            _ => Ok(()),
        };
    }
    s.push_str("  return 1\nend\n");
}

/// How long a calendar window's state outlives its period's end: a replica whose clock is
/// behind may still send the period that just ended, and must find its count (an hour).
const CALENDAR_KEEP_MS: u64 = 3_600_000;

fn cost_of(counts_cost: bool) -> &'static str {
    if counts_cost { "cost" } else { "1" }
}

/// Exact integer division and floor(a*b/c) in Lua's doubles, shared by the acquisition
/// and the correction scripts.
const MULDIV: &str = r#"
local function divmod(x, m)
  local q = floor(x / m)
  local r = x - q * m
  if r < 0 then q = q - 1; r = r + m elseif r >= m then q = q + 1; r = r - m end
  return q, r
end

-- floor(a*b/c) and the remainder, exact for 0 <= a, b < c < 2^53
local function muldiv(a, b, c)
  local p = a * b
  if p < 9007199254740992 then return divmod(p, c) end
  local q, r, bit = 0, 0, 1
  while bit * 2 <= b do bit = bit * 2 end
  while bit >= 1 do
    q = q * 2
    if r >= c - r then r = r - (c - r); q = q + 1 else r = r + r end
    if b >= bit then
      b = b - bit
      if r >= c - a then r = r - (c - a); q = q + 1 else r = r + a end
    end
    bit = bit / 2
  end
  return q, r
end
"#;

/// The sliding-window counter's view of a state, for acquisitions.
const COUNTER: &str = r#"  -- the window holding now (never before the state's): start, elapsed ns, previous, current
  local function cview(v, wus)
    local st, a, b = 0, 0, 0
    if v then local s1, p1, c1 = match(v, '^(%d+):(%d+):(%d+)$'); st, a, b = tonumber(s1), tonumber(p1), tonumber(c1) end
    local ws, e = st, 0
    if st <= NOW_US then local r = NOW_US % wus; ws, e = NOW_US - r, r * 1000 + NOW_SUB end
    if ws ~= st then if ws - st == wus then a, b = b, 0 else a, b = 0, 0 end end
    return ws, e, a, b
  end
  -- floor(room*w/prev) for 0 <= room < prev
  local function slack(room, prev, w)
    local qw = floor(w / prev)
    return room * qw + muldiv(room, w - qw * prev, prev)
  end
  -- the earliest offset into a window with counts prev, curr at which c fits, if any
  local function cearliest(lim, w, prev, curr, c)
    local room = lim - curr - c
    if room < 0 then return nil end
    if prev == 0 or room >= prev then return 0 end
    local e = w - slack(room, prev, w)
    if e < 0 then e = 0 end
    if e < w then return e end
    return nil
  end
  local function ccheck(lim, w, prev, curr, e, c)
    local room = lim - curr - c
    if room >= 0 and (prev == 0 or room >= prev or w - e <= slack(room, prev, w)) then return nil end
    local e1 = cearliest(lim, w, prev, curr, c)
    if e1 then return e1 - e end
    local e2 = cearliest(lim, w, curr, 0, c)
    if e2 then return w + e2 - e end
    return 2 * w - e
  end
  local function cpeek(lim, w, prev, curr, e)
    local y, c = w - e, 0
    if prev > 0 then
      if y == w then c = prev
      else
        local qx = floor(prev / w)
        local q, r = muldiv(prev - qx * w, y, w)
        c = qx * y + q
        if r > 0 then c = c + 1 end
      end
    end
    local rem = lim - c
    if rem < 0 then rem = 0 end
    rem = rem - curr
    if rem < 0 then rem = 0 end
    if curr > 0 then return rem, 2 * w - e end
    if prev > 0 then return rem, w - e end
    return rem, 0
  end
"#;

/// The sliding-window log, for acquisitions: a sorted set of grants and its sum.
const LOG: &str = r#"  local function lentry(m)
    local us, sb, c = match(m, '^(%d+)%.(%d+):(%d+):')
    return tonumber(us), tonumber(sb), tonumber(c)
  end
  -- the live sum, and what a commit must prune
  local function lload(k, wus)
    local t = call('ZSCORE', k, '=')
    local sum, cut, dsum, dead, bound = t and (-tonumber(t) - 1) or 0, NOW_US - wus, 0, false, {}
    if cut >= 0 then
      local ms = call('ZRANGEBYSCORE', k, 0, fmt('%.0f', cut))
      for j = 1, #ms do
        local us, sb, c = lentry(ms[j])
        if us < cut or sb <= NOW_SUB then
          dsum, dead = dsum + c, true
          if us == cut then bound[#bound + 1] = ms[j] end
        end
      end
    end
    return {live = sum - dsum, dead = dead, bound = bound, cut = cut}
  end
  -- nil when c fits, else the wait until enough of the oldest live grants have left
  local function lcheck(k, st, lim, w, c)
    local over = st.live + c - lim
    if over <= 0 then return nil end
    local freed, off, from = 0, 0, fmt('%.0f', st.cut < 0 and 0 or st.cut)
    while true do
      local ms = call('ZRANGEBYSCORE', k, from, '+inf', 'LIMIT', off, 64)
      if #ms == 0 then break end
      for j = 1, #ms do
        local us, sb, cj = lentry(ms[j])
        if us > st.cut or sb > NOW_SUB then
          freed = freed + cj
          if freed >= over then return (us - NOW_US) * 1000 + sb - NOW_SUB + w end
        end
      end
      off = off + #ms
    end
    return w
  end
  local function lcommit(k, st, c, uid, w)
    if st.dead then
      call('ZREMRANGEBYSCORE', k, 0, '(' .. fmt('%.0f', st.cut))
      if #st.bound > 0 then call('ZREM', k, unpack(st.bound)) end
    end
    if c > 0 then
      call('ZADD', k, fmt('%.0f', NOW_US), fmt('%.0f.%03d:%.0f:%s', NOW_US, NOW_SUB, c, uid))
      st.newest = 0
    end
    st.live = st.live + c
    call('ZADD', k, fmt('%.0f', -st.live - 1), '=')
    call('PEXPIRE', k, floor(w / 1000000) + 2 + SLACK_MS)
  end
  local function lpeek(k, st, lim, w)
    local rem = lim - st.live
    if rem < 0 then rem = 0 end
    local newest = st.newest
    if not newest then
      local m = call('ZRANGE', k, -1, -1)[1]
      if m and m ~= '=' then local us, sb = lentry(m); newest = (us - NOW_US) * 1000 + sb - NOW_SUB end
    end
    if newest and newest + w > 0 then return rem, newest + w end
    return rem, 0
  end
"#;

/// Settle and renew, generic over the table `L` of the set's limits.
const SETTLE: &str = r#"
local function num(x) return fmt('%.0f', x) end

-- nanoseconds from now to the instant (us, sub)
local function rel(us, sub) return (us - NOW_US) * 1000 + (sub - NOW_SUB) end

-- the instant `ns` nanoseconds from now, as a theoretical arrival time is stored: whole
-- microseconds as a number, or `us.nnn` when there are nanoseconds
local function abs_ns(ns)
  local q, r = divmod(NOW_SUB + ns, 1000)
  if r == 0 then return NOW_US + q end
  return fmt('%.0f.%03d', NOW_US + q, r)
end

-- a stored theoretical arrival time: (us, sub)
local function parse_ns(v)
  if byte(v, -4) == 46 then return tonumber(sub(v, 1, -5)), tonumber(sub(v, -3)) end
  return tonumber(v), 0
end

-- milliseconds to keep a state that is idle `ns` from now
local function ttl(ns) return floor(ns / 1000000) + 2 + SLACK_MS end

-- the aligned window (start us, elapsed ns) for a window of wus microseconds; never
-- before `start`, the window a state was last written in
local function align(wus, start)
  if start > NOW_US then return start, 0 end
  local _, r = divmod(NOW_US, wus)
  return NOW_US - r, r * 1000 + NOW_SUB
end

local function log_entry(m)
  local us, sub, c = match(m, '^(%d+)%.(%d+):(%d+):')
  return tonumber(us), tonumber(sub), tonumber(c)
end

local function sum_of(k)
  local s = call('ZSCORE', k, '=')
  if s then return -tonumber(s) - 1 end
  return 0
end

local function load(i)
  local p, k = L[i], KEYS[i]
  local kind = p[1]
  if kind == 1 then
    local v = call('GET', k)
    local d = -1
    if v then d = rel(parse_ns(v)) end
    return {raw = d, debt = d > 0 and d or 0}
  elseif kind == 2 or kind == 3 then
    local v = call('GET', k)
    local start, a, b = 0, 0, 0
    if v then
      if kind == 2 then
        local s1, c1 = match(v, '^(%d+):(%d+)$')
        start, b = tonumber(s1), tonumber(c1)
      else
        local s1, p1, c1 = match(v, '^(%d+):(%d+):(%d+)$')
        start, a, b = tonumber(s1), tonumber(p1), tonumber(c1)
      end
    end
    local ws, e = align(p[5], start)
    if ws ~= start then
      if ws - start == p[5] then a, b = b, 0 else a, b = 0, 0 end
    end
    if kind == 2 then a = 0 end
    return {ws = ws, e = e, prev = a, curr = b}
  elseif kind == 4 then
    local sum = sum_of(k)
    local cut = NOW_US - p[5]
    local dsum, dead, bound = 0, false, {}
    if cut >= 0 then
      local ms = call('ZRANGEBYSCORE', k, 0, num(cut))
      for j = 1, #ms do
        local us, sub, c = log_entry(ms[j])
        if us < cut or sub <= NOW_SUB then
          dsum = dsum + c
          dead = true
          if us == cut then bound[#bound + 1] = ms[j] end
        end
      end
    end
    return {live = sum - dsum, dead = dead, bound = bound, cut = cut, newest = nil}

  end
end

-- floor(room*W/prev) for 0 <= room < prev: how far back from the end of a window the
-- previous window's weight still fits
-- one limit from the charged cost `old` to `new`, for a grant made at (gus, gsub)
local function adjust(i, old, new, gus, gsub, uid)
  local p, k = L[i], KEYS[i]
  local kind = p[1]
  if kind == 1 then
    local st = load(i)
    local d
    if new > old then
      d = st.debt + (new - old) * p[3]
    else
      if st.raw <= 0 then return end
      d = st.raw - (old - new) * p[3]
      if d <= 0 then call('DEL', k); return end
    end
    call('SET', k, abs_ns(d), 'PX', ttl(d))
  elseif kind == 2 or kind == 3 then
    local st = load(i)
    local _, gr = divmod(gus, p[5])
    local gw = gus - gr
    local f = function(x) x = x + new - old; if x < 0 then x = 0 end; return x end
    if gw == st.ws then st.curr = f(st.curr)
    elseif kind == 3 and gw + p[5] == st.ws then st.prev = f(st.prev)
    else return end
    if kind == 2 then
      call('SET', k, num(st.ws) .. ':' .. num(st.curr), 'PX', ttl(p[4] - st.e))
    else
      call('SET', k, num(st.ws) .. ':' .. num(st.prev) .. ':' .. num(st.curr), 'PX', ttl(2 * p[4] - st.e))
    end
  elseif kind == 6 then
    -- only a grant of the period the state counts, while it lasts
    local v = call('GET', k)
    if not v then return end
    local a, b, c = match(v, '^(%d+):(%d+):(%d+)$')
    a, b, c = tonumber(a), tonumber(b), tonumber(c)
    if gus < a or gus >= b or NOW_US >= b then return end
    c = c + new - old
    if c < 0 then c = 0 end
    call('SET', k, num(a) .. ':' .. num(b) .. ':' .. num(c), 'PX', floor((b - NOW_US) / 1000) + CALENDAR_KEEP_MS + SLACK_MS)
  elseif kind == 4 then
    local live = rel(gus, gsub) + p[4] > 0
    local sum, changed = sum_of(k), false
    if old > 0 and call('ZREM', k, fmt('%.0f.%03d:%.0f:%s', gus, gsub, old, uid)) == 1 then
      sum = sum - old
      changed = true
    end
    -- a refund puts back what is left of the grant's own entry; a charge adds to it
    -- (or makes it again) while the grant is still in the window
    if live and new > 0 and (changed or new > old) then
      call('ZADD', k, num(gus), fmt('%.0f.%03d:%.0f:%s', gus, gsub, new, uid))
      sum = sum + new
      changed = true
      local need = ttl(rel(gus, gsub) + p[4])
      if call('PTTL', k) < need then call('PEXPIRE', k, need) end
    end
    if sum < 0 then sum = 0 end
    if changed then call('ZADD', k, num(-sum - 1), '=') end
  end
end

local function settle(uid, gus, gsub, acq, oq, nq, oc, nc, rel_)
  for i = 1, #L do
    local p, k = L[i], KEYS[i]
    if p[1] == 5 then
      if rel_ == 1 then
        if p[2] == 0 then
          call('ZREM', k, uid .. ':1')
        elseif acq > 0 and call('ZREM', k, uid .. ':' .. num(acq)) == 1 then
          local held = sum_of(k) - acq
          if held < 0 then held = 0 end
          if held == 0 and call('ZCARD', k) == 1 then call('DEL', k)
          else call('ZADD', k, num(-held - 1), '=') end
        end
      end
    else
      local o, n = oq, nq
      if p[2] == 1 then o, n = oc, nc end
      if n ~= o then adjust(i, o, n, gus, gsub, uid) end
    end
  end
  return 1
end

local function renew(uid, acq)
  local renewed = 0
  for i = 1, #L do
    local p, k = L[i], KEYS[i]
    if p[1] == 5 then
      local w = p[2] == 1 and acq or 1
      local m = uid .. ':' .. num(w)
      local deadline = w > 0 and call('ZSCORE', k, m)
      -- only a live lease: an expired one may have been counted free and taken since
      if deadline and tonumber(deadline) > NOW_US then
        renewed = renewed + call('ZADD', k, 'XX', 'GT', 'CH', num(NOW_US + LEASE_US), m)
        call('PEXPIRE', k, ttl(LEASE_US * 1000) + 1000)
      end
    end
  end
  return renewed
end

local op = ARGV[1]
if op == 's' then
  return settle(ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]),
    tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12]))
end
if op == 'n' then return renew(ARGV[4], tonumber(ARGV[5])) end
return redis.error_reply('tower-limits: unknown operation')
"#;
