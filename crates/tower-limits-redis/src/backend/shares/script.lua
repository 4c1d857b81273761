-- tower-limits-redis: capacity shares of rate limits (see the backend's shares module)
--
-- KEYS are share tables, one per limit and scope. A table is a hash: field `p` holds the
-- pool, the tokens no replica holds times the period in us (an integer, negative after a
-- charge beyond it), `t` the server time it was counted at (us), and one field per
-- replica holding a share, `rate:burst:expiry_us:demand`. Every number stays below 2^53,
-- where doubles count integers exactly: the builder refuses a burst times period beyond.
--
-- ARGV[1] the operation, ARGV[2] the replica, ARGV[3] the caller's time in us (tests
-- with a manual clock) or '' for the server's, ARGV[4] the lifetime of a share (us),
-- ARGV[5] that of a semaphore's share in Redis (the backend's lease: a replica's permits
-- in flight outlive the share it took them under);
-- then per key: the limit's amount A per period P (us), its burst B, and what the
-- operation needs.
local call, floor, min, max, fmt, match, tonumber = redis.call, math.floor, math.min, math.max, string.format, string.match, tonumber
local op, me = ARGV[1], ARGV[2]
-- With the caller's clock (tests), keys expire an hour later than their state needs: the
-- test's time does not run with the server's, which would otherwise expire them early.
local now, slack = nil, 0
if ARGV[3] ~= '' then
  now, slack = tonumber(ARGV[3]), 3600000
else
  local T = call('TIME')
  now = T[1] * 1000000 + T[2]
end
local life, plife = tonumber(ARGV[4]), tonumber(ARGV[5])

-- A table brought to now. The pool refills at the rate no replica holds, up to the burst
-- no replica holds; a share that expired counts as held until now, then is removed.
local function load(key, A, B, P)
  local h = call('HGETALL', key)
  local s = {key = key, A = A, B = B, P = P, p = nil, t = now, rate = 0, burst = 0, last = now, e = {}}
  for i = 1, #h, 2 do
    local f, v = h[i], h[i + 1]
    if f == 'p' then
      s.p = tonumber(v)
    elseif f == 't' then
      s.t = tonumber(v)
    else
      local r, b, x, d = match(v, '^(%d+):(%d+):(%d+):(%d+)$')
      if r then
        local e = {r = tonumber(r), b = tonumber(b), x = tonumber(x), d = tonumber(d)}
        s.e[f] = e
        s.rate, s.burst = s.rate + e.r, s.burst + e.b
      end
    end
  end
  local cap, free = (B - s.burst) * P, A - s.rate
  if s.p == nil then
    -- A table that does not exist is a full bucket, as a fresh GCRA is.
    s.p = cap
  elseif now > s.t and s.p < cap and free > 0 then
    -- Exact below the cap; a sum beyond 2^53 is inexact but above the cap, which it
    -- becomes.
    s.p = min(cap, s.p + (now - s.t) * free)
  end
  s.t = now
  for f, e in pairs(s.e) do
    if e.x <= now then
      call('HDEL', key, f)
      s.e[f] = nil
      s.rate, s.burst = s.rate - e.r, s.burst - e.b
    elseif e.x > s.last then
      s.last = e.x
    end
  end
  return s
end

-- Writes the pool back; the table expires once it is indistinguishable from a fresh one:
-- every share ended and the pool refilled at the full rate.
local function save(s)
  local cap = (s.B - s.burst) * s.P
  if s.p > cap then s.p = cap end
  call('HSET', s.key, 'p', fmt('%.0f', s.p), 't', fmt('%.0f', now))
  local refill = (s.B * s.P - min(s.p, s.B * s.P)) / s.A
  call('PEXPIRE', s.key, floor((s.last - now + refill) / 1000) + 2 + slack)
end

-- The max-min fair allotment of A among the demands: every demand below the level is met,
-- the others get the level.
local function level(A, ds)
  table.sort(ds)
  local left, n = A, #ds
  for i = 1, n do
    local fair = left / (n - i + 1)
    if ds[i] > fair then return floor(fair) end
    left = left - ds[i]
  end
  return A
end

local out = {now}
if op == 'R' then
  -- Refresh: per key A, P, B, what this replica may be using now, its demand (units per
  -- period), and tokens it gives back. Answers per key the share it may use from now,
  -- its burst, and tokens from the pool.
  local a = 6
  for k = 1, #KEYS do
    local A, P, B = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local using, demand, back = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
    a = a + 6
    local s = load(KEYS[k], A, B, P)
    local mine = s.e[me]
    if mine then
      s.rate, s.burst = s.rate - mine.r, s.burst - mine.b
      s.e[me] = nil
    end
    s.p = s.p + back * P
    local ds = {demand}
    for _, e in pairs(s.e) do ds[#ds + 1] = e.d end
    local lvl = level(A, ds)
    -- A semaphore's share is its demand (the most held or asked at once): the permits
    -- no demand claims stay free, for a replica fetching more to find at once rather
    -- than a refusal until the others' next refresh.
    local target = min(demand, lvl)
    local new = min(target, A - s.rate)
    -- A share of a rate too small to hold one unit of burst stays in the pool. (A burst of
    -- 0 marks a semaphore: its shares are permits, and it has no pool.)
    if B > 0 and new > 0 and floor(B * new / A) < 1 then new = 0 end
    -- Until this replica confirms a smaller share, the larger one stays counted.
    local held = max(using, new)
    local bheld, bnew = floor(B * held / A), floor(B * new / A)
    local gift = 0
    if bnew > floor(B * using / A) and s.p >= P then
      gift = min(floor(s.p / P), bnew - floor(B * using / A))
      s.p = s.p - gift * P
    end
    -- A replica holding nothing keeps its demand on record, so that the others' next
    -- allotments make room for it.
    if held > 0 or demand > 0 then
      local x = now + life
      if B == 0 then x = now + plife end
      call('HSET', s.key, me, fmt('%.0f:%.0f:%.0f:%.0f', held, bheld, x, demand))
      s.rate, s.burst = s.rate + held, s.burst + bheld
      if x > s.last then s.last = x end
    else
      call('HDEL', s.key, me)
    end
    save(s)
    out[#out + 1] = new
    out[#out + 1] = bnew
    out[#out + 1] = gift
  end
  return out
elseif op == 'P' then
  -- Take from the pools, all or nothing: per key A, P, B and the units. Answers 1, or 0,
  -- the blocking key (from 1) and its wait in us (-1: no rate is free of shares).
  local a, ss = 6, {}
  local blocked, wait = 0, 0
  for k = 1, #KEYS do
    local A, P, B, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    a = a + 4
    local s = load(KEYS[k], A, B, P)
    s.n = n
    ss[k] = s
    if blocked == 0 and s.p < n * P then
      blocked = k
      local free = A - s.rate
      if free > 0 then wait = floor((n * P - s.p + free - 1) / free) else wait = -1 end
    end
  end
  for k = 1, #KEYS do
    if blocked == 0 then ss[k].p = ss[k].p - ss[k].n * ss[k].P end
    save(ss[k])
  end
  if blocked == 0 then
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
    out[#out + 1] = blocked
    out[#out + 1] = wait
  end
  return out
elseif op == 'S' then
  -- Settle with the pools: per key A, P, B and the units to give back (negative: to
  -- charge more).
  local a = 6
  for k = 1, #KEYS do
    local A, P, B, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    a = a + 4
    local s = load(KEYS[k], A, B, P)
    s.p = s.p + n * P
    save(s)
  end
  return out
end
return redis.error_reply('unknown operation ' .. tostring(op))
