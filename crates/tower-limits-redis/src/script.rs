//! The Lua script of a limit set: how one round trip decides every limit.
//!
//! # One script per set
//!
//! A set's script is generated once, when the backend is built: a fixed library of Lua
//! functions preceded by the set's limits as constants (kind,
//! whether it counts cost, emission interval, tolerance, window, capacity). Redis caches
//! it by its SHA1; every call is an `EVALSHA`, and a `NOSCRIPT` answer (the cache was
//! flushed, or a failover promoted a replica that never saw the script) is followed by
//! one `EVAL` of the full text, which caches it again.
//!
//! `KEYS` are the set's keys for one tenant, one per limit in the order of the policy.
//! `ARGV[1]` selects the operation:
//!
//! - `a`, acquire: read the server's `TIME` once, load every limit's state, check every
//!   limit **without writing**, and only if all pass commit all of them. The reply is a
//!   flat array of integers: `granted, now_us, now_sub, blocking index, retry_after_ns,
//!   needs_release`, then `remaining, reset_ns` for every limit (after the grant, or as
//!   they stand on a denial).
//! - `s`, settle: correct the limits that count cost from the charged cost to the real
//!   one (a charge or a refund), and optionally release the grant's semaphore holds.
//!   Cancel is a settle to zero with a release.
//! - `n`, renew: push the grant's semaphore lease deadlines to `now + lease`.
//!
//! # Time and exact integers
//!
//! Redis runs Lua 5.1, whose only numbers are doubles, exact for integers below 2^53.
//! Absolute times are therefore kept as whole microseconds (the resolution of `TIME`;
//! about 1.8e15 today) plus a sub-microsecond part in nanoseconds that is zero unless a
//! test drives the clock. Everything the algorithms compare is a *difference* from now in
//! nanoseconds, which stays below 2^53 (104 days) because the builder refuses longer
//! windows and tolerances. The one product that can exceed 2^53, in the sliding-window
//! counter, goes through `muldiv`, an exact `floor(a*b/c)` by doubling. Numbers that go
//! back to Redis as arguments are formatted with `%.0f`, never with Lua's `tostring`,
//! which would round them to 14 digits.
//!
//! # State per limit
//!
//! | kind | Redis type | value |
//! |---|---|---|
//! | GCRA, token bucket | string | the theoretical arrival time, integer ns since the epoch of the server clock |
//! | fixed window | string | `window_start_us:count` |
//! | sliding-window counter | string | `window_start_us:previous:current` |
//! | sliding-window log | sorted set | one member `at_us.at_sub:cost:holder` per grant, scored by `at_us`; member `=` scored `-(sum+1)` |
//! | semaphore | sorted set | one member `holder:weight` per grant, scored by its lease deadline (us); member `=` scored `-(held+1)` |
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
    /// Semaphore: capacity.
    Semaphore { cost: bool, capacity: u64 },
}

/// The script of one set.
pub(crate) fn generate(limits: &[ScriptLimit], lease_us: u64, manual_clock: bool) -> String {
    let mut s = String::with_capacity(LIBRARY.len() + 512);
    s.push_str("-- tower-limits-redis: the limit script of one set (see the crate docs)\n");
    s.push_str("local L = {\n");
    for l in limits {
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
        };
    }
    s.push_str("}\n");
    let _ = writeln!(s, "local LEASE_US = {lease_us}");
    if manual_clock {
        // Test-only: the caller's clock, and expiries an hour longer so that keys never
        // expire in real time before they are idle in the test's time.
        s.push_str("local NOW_US, NOW_SUB = tonumber(ARGV[2]), tonumber(ARGV[3])\nlocal SLACK_MS = 3600000\n");
    } else {
        s.push_str(
            "local T = redis.call('TIME')\nlocal NOW_US, NOW_SUB = T[1] * 1000000 + T[2], 0\nlocal SLACK_MS = 0\n",
        );
    }
    s.push_str(LIBRARY);
    s
}

/// The functions and the dispatch shared by every set's script.
pub(crate) const LIBRARY: &str = r#"
local floor, fmt, match, tonumber = math.floor, string.format, string.match, tonumber
local call = redis.call

-- q, r with x = q*m + r and 0 <= r < m, exact for integers below 2^53
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

local function num(x) return fmt('%.0f', x) end

-- nanoseconds from now to the instant (us, sub)
local function rel(us, sub) return (us - NOW_US) * 1000 + (sub - NOW_SUB) end

-- the instant `ns` nanoseconds from now, as an integer of nanoseconds
local function abs_ns(ns)
  local q, r = divmod(NOW_SUB + ns, 1000)
  return fmt('%.0f%03d', NOW_US + q, r)
end

local function parse_ns(v)
  local n = #v
  if n <= 3 then return 0, tonumber(v) end
  return tonumber(string.sub(v, 1, n - 3)), tonumber(string.sub(v, n - 2))
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
  else
    local held = sum_of(k)
    local ms = call('ZRANGEBYSCORE', k, 0, num(NOW_US))
    local w = 0
    for j = 1, #ms do w = w + tonumber(match(ms[j], ':(%d+)$')) end
    return {live = held - w, expired = #ms > 0}
  end
end

-- floor(room*W/prev) for 0 <= room < prev: how far back from the end of a window the
-- previous window's weight still fits
local function slack(room, prev, w)
  local qw, rw = divmod(w, prev)
  return room * qw + muldiv(room, rw, prev)
end

local function counter_fits(p, prev, curr, e, c)
  local room = p[3] - curr - c
  if room < 0 then return false end
  if prev == 0 or room >= prev then return true end
  return p[4] - e <= slack(room, prev, p[4])
end

-- the earliest offset into a window with counts prev, curr at which c fits, if any
local function counter_earliest(p, prev, curr, c)
  local room = p[3] - curr - c
  if room < 0 then return nil end
  if prev == 0 or room >= prev then return 0 end
  local e = p[4] - slack(room, prev, p[4])
  if e < 0 then e = 0 end
  if e < p[4] then return e end
  return nil
end

-- nil when c fits, else the exact wait in ns, or false when only a release can help
local function check(i, st, c)
  local p = L[i]
  local kind = p[1]
  if kind == 1 then
    local new = st.debt + c * p[3]
    if new > p[4] then return new - p[4] end
    return nil
  elseif kind == 2 then
    if st.curr + c <= p[3] then return nil end
    return p[4] - st.e
  elseif kind == 3 then
    if counter_fits(p, st.prev, st.curr, st.e, c) then return nil end
    local e1 = counter_earliest(p, st.prev, st.curr, c)
    if e1 then return e1 - st.e end
    local e2 = counter_earliest(p, st.curr, 0, c)
    if e2 then return p[4] + e2 - st.e end
    return 2 * p[4] - st.e
  elseif kind == 4 then
    local over = st.live + c - p[3]
    if over <= 0 then return nil end
    local k, freed, off = KEYS[i], 0, 0
    local from = st.cut < 0 and 0 or st.cut
    while true do
      local ms = call('ZRANGEBYSCORE', k, num(from), '+inf', 'LIMIT', off, 64)
      if #ms == 0 then break end
      for j = 1, #ms do
        local us, sub, cj = log_entry(ms[j])
        if us > st.cut or sub > NOW_SUB then
          freed = freed + cj
          if freed >= over then return rel(us, sub) + p[4] end
        end
      end
      off = off + #ms
    end
    return p[4]
  else
    if st.live + c > p[3] then return false end
    return nil
  end
end

local function log_prune(k, st)
  if st.dead then
    call('ZREMRANGEBYSCORE', k, 0, '(' .. num(st.cut))
    if #st.bound > 0 then call('ZREM', k, unpack(st.bound)) end
    st.dead = false
  end
end

local function commit(i, st, c, uid)
  local p, k = L[i], KEYS[i]
  local kind = p[1]
  if kind == 1 then
    local new = st.debt + c * p[3]
    call('SET', k, abs_ns(new), 'PX', ttl(new))
    st.debt = new
  elseif kind == 2 then
    st.curr = st.curr + c
    call('SET', k, num(st.ws) .. ':' .. num(st.curr), 'PX', ttl(p[4] - st.e))
  elseif kind == 3 then
    st.curr = st.curr + c
    call('SET', k, num(st.ws) .. ':' .. num(st.prev) .. ':' .. num(st.curr), 'PX', ttl(2 * p[4] - st.e))
  elseif kind == 4 then
    log_prune(k, st)
    if c > 0 then
      call('ZADD', k, num(NOW_US), fmt('%.0f.%03d:%.0f:%s', NOW_US, NOW_SUB, c, uid))
      st.newest = 0
    end
    st.live = st.live + c
    call('ZADD', k, num(-st.live - 1), '=')
    call('PEXPIRE', k, ttl(p[4]))
  else
    if st.expired then call('ZREMRANGEBYSCORE', k, 0, num(NOW_US)) end
    if c > 0 then call('ZADD', k, num(NOW_US + LEASE_US), uid .. ':' .. num(c)) end
    st.live = st.live + c
    call('ZADD', k, num(-st.live - 1), '=')
    call('PEXPIRE', k, ttl(LEASE_US * 1000) + 1000)
  end
end

-- remaining and reset (ns) of limit i
local function peek(i, st)
  local p = L[i]
  local kind = p[1]
  if kind == 1 then
    local room = p[4] - st.debt
    if room < 0 then room = 0 end
    return (divmod(room, p[3])), st.debt
  elseif kind == 2 then
    local rem = p[3] - st.curr
    if rem < 0 then rem = 0 end
    if st.curr > 0 then return rem, p[4] - st.e end
    return rem, 0
  elseif kind == 3 then
    local w, y, c = p[4], p[4] - st.e, 0
    if st.prev > 0 then
      if y == w then c = st.prev
      else
        local qx, rx = divmod(st.prev, w)
        local q, r = muldiv(rx, y, w)
        c = qx * y + q
        if r > 0 then c = c + 1 end
      end
    end
    local rem = p[3] - c
    if rem < 0 then rem = 0 end
    rem = rem - st.curr
    if rem < 0 then rem = 0 end
    if st.curr > 0 then return rem, 2 * w - st.e end
    if st.prev > 0 then return rem, w - st.e end
    return rem, 0
  elseif kind == 4 then
    local rem = p[3] - st.live
    if rem < 0 then rem = 0 end
    local newest = st.newest
    if not newest then
      local m = call('ZRANGE', KEYS[i], -1, -1)[1]
      if m and m ~= '=' then newest = rel(log_entry(m)) end
    end
    if newest and newest + p[4] > 0 then return rem, newest + p[4] end
    return rem, 0
  else
    local rem = p[3] - st.live
    if rem < 0 then rem = 0 end
    return rem, 0
  end
end

local function acquire(cost, uid)
  local n, S, C = #L, {}, {}
  local blocked, retry, release = 0, 0, 0
  for i = 1, n do
    C[i] = L[i][2] == 1 and cost or 1
    S[i] = load(i)
    local r = check(i, S[i], C[i])
    if r == false then
      release = 1
      if blocked == 0 then blocked = i end
    elseif r then
      if r >= retry then retry = r; blocked = i end
    end
  end
  local out = {0, NOW_US, NOW_SUB, 0, retry, release}
  if blocked == 0 then
    out[1] = 1
    for i = 1, n do commit(i, S[i], C[i], uid) end
  else
    out[4] = blocked - 1
  end
  for i = 1, n do
    local rem, rs = peek(i, S[i])
    out[#out + 1] = rem
    out[#out + 1] = rs
  end
  return out
end

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
      local w = p[2] == 1 and acq or 1
      if rel_ == 1 and w > 0 and call('ZREM', k, uid .. ':' .. num(w)) == 1 then
        local held = sum_of(k) - w
        if held < 0 then held = 0 end
        if held == 0 and call('ZCARD', k) == 1 then call('DEL', k)
        else call('ZADD', k, num(-held - 1), '=') end
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
      if w > 0 then
        renewed = renewed + call('ZADD', k, 'XX', 'GT', 'CH', num(NOW_US + LEASE_US), uid .. ':' .. num(w))
        call('PEXPIRE', k, ttl(LEASE_US * 1000) + 1000)
      end
    end
  end
  return renewed
end

local op = ARGV[1]
if op == 'a' then return acquire(tonumber(ARGV[4]), ARGV[5]) end
if op == 's' then
  return settle(ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]),
    tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12]))
end
if op == 'n' then return renew(ARGV[4], tonumber(ARGV[5])) end
return redis.error_reply('tower-limits: unknown operation')
"#;
