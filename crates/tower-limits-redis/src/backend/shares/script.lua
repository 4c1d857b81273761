-- tower-limits-redis: capacity shares of rate limits (see the backend's shares module)
--
-- KEYS are share tables, one per limit and scope. A table is a hash: field `p` holds the
-- pool, the tokens no replica holds times the period in us (an integer, negative after a
-- charge beyond it), `t` the server time it was counted at (us), and one field per
-- replica holding a share, `rate:burst:expiry_us:demand`. Every number stays below 2^53,
-- where doubles count integers exactly: the builder refuses a burst times period beyond.
--
-- A window's table (a fixed or calendar window, leased in blocks of units) is a hash
-- too: `w` holds the window's start (the callers' clock: a replica tells its window with
-- each call), `u` the units spent in it, and one field per replica holding a block,
-- `held:counted:expiry:demand`, `counted` being the replica's cumulative spending in the
-- window that `u` already holds (a report repeats the cumulative figure, so a lost reply
-- never counts it twice). A window's arguments put its bounds, `start:end`, where a rate
-- has its period, and -1 where a rate has its burst.
--
-- ARGV[1] the operation, ARGV[2] the replica, ARGV[3] the caller's time in us (tests
-- with a manual clock) or '' for the server's, ARGV[4] the lifetime of a share (us),
-- ARGV[5] that of a semaphore's share in Redis (the backend's lease: a replica's permits
-- in flight outlive the share it took them under);
-- then per key: the limit's amount A per period P (us), its burst B, and what the
-- operation needs. (A refresh, G, carries a replica and lifetimes per part instead.)
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

-- A window's table brought to now. A table of an earlier window starts over (a block of
-- it is worth nothing in this one); a block that expired unrenewed counts as spent: its
-- replica may have spent all of it, and nobody can tell how much it did. A caller whose
-- clock is behind the table's window is `stale`: it counts in the table's window.
local function wload(key, A, spec)
  local ws, we = match(spec, '^(%d+):(%d+)$')
  local s = {key = key, A = A, w = tonumber(ws), we = tonumber(we), u = 0, held = 0, e = {}, stale = false}
  local h = call('HGETALL', key)
  local w, entries = nil, {}
  for i = 1, #h, 2 do
    local f, v = h[i], h[i + 1]
    if f == 'w' then
      w = tonumber(v)
    elseif f == 'u' then
      s.u = tonumber(v)
    else
      local held, c, x, d = match(v, '^(%d+):(-?%d+):(%d+):(%d+)$')
      if held then entries[f] = {h = tonumber(held), c = tonumber(c), x = tonumber(x), d = tonumber(d)} end
    end
  end
  if w == nil or w < s.w then
    if #h > 0 then call('DEL', key) end
    s.u, s.fresh = 0, true
    return s
  end
  if w > s.w then s.stale, s.w = true, w end
  for f, e in pairs(entries) do
    if e.x <= now then
      call('HDEL', key, f)
      s.u = s.u + e.h
    else
      s.e[f] = e
      s.held = s.held + e.h
    end
  end
  return s
end

-- Writes a window's count back; the table lives until its window ends and its blocks
-- with it (a stale caller does not know when that is, and a settle does not change it).
local function wsave(s, settle)
  if s.u < 0 then s.u = 0 end
  call('HSET', s.key, 'w', fmt('%.0f', s.w), 'u', fmt('%.0f', s.u))
  if not (s.stale or settle) then
    call('PEXPIRE', s.key, floor(max(s.we - now, life) / 1000) + 2 + slack)
  end
end

local out = {now}

-- A refresh of `n` keys from KEYS[k0] on, their arguments from ARGV[a] on: per key A, P,
-- B, what the replica `me` may be using now, its demand (units per period), and tokens it
-- gives back. Answers per key the share it may use from now, its burst, and tokens from
-- the pool. Returns where the next arguments start.
local function refresh(k0, n, a)
  for k = k0, k0 + n - 1 do
    local A, P, B = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local using, demand, back = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
    local spec = ARGV[a + 1]
    a = a + 6
    if B == -1 then
      -- A window: `using` is the block the replica holds now, `back` its cumulative
      -- spending in the window. Answers the units granted (negative: to give back), the
      -- units spent or held by no other replica (-1: the caller's window is over), 0.
      local s = wload(KEYS[k], A, spec)
      if s.stale then
        out[#out + 1], out[#out + 2], out[#out + 3] = 0, -1, 0
      else
        local mine = s.e[me]
        -- Without a block on record, what the replica spent so far is counted: as the
        -- block that expired, or it is nothing.
        if mine then
          s.u = s.u + back - mine.c
          s.held = s.held - mine.h
          s.e[me] = nil
        end
        local avail = A - s.u
        local ds = {demand}
        for _, e in pairs(s.e) do ds[#ds + 1] = e.d end
        local lvl = level(max(avail, 0), ds)
        local held, g = using, 0
        if min(demand, lvl) > held then
          g = min(min(demand, lvl) - held, max(avail - s.held - held, 0))
          held = held + g
        elseif held > lvl then
          -- Others are short: the part above the level goes back, counted as held until
          -- the replica reports it gone.
          g = lvl - held
        end
        if held > 0 or demand > 0 then
          call('HSET', s.key, me, fmt('%.0f:%.0f:%.0f:%.0f', held, back, now + life, demand))
        else
          call('HDEL', s.key, me)
        end
        wsave(s)
        out[#out + 1], out[#out + 2], out[#out + 3] = g, max(avail - s.held, 0), 0
      end
    else
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
      -- A pool in debt (units booked ahead, or a charge beyond what it held) repays it at
      -- the rate no share holds: no share grows until it has, so a booking is never due
      -- before the pool refilled it.
      if B > 0 and s.p < 0 then new = min(new, using) end
      -- A share of a rate too small to hold one unit of burst stays in the pool. (A burst of
      -- 0 marks a semaphore: its shares are permits, and it has no pool.)
      if B > 0 and new > 0 and floor(B * new / A) < 1 then new = 0 end
      -- Until this replica confirms a smaller share, the larger one stays counted. A new
      -- burst takes no more than the others' bursts leave, bookings included (the burst
      -- the replica may still be using is within that already).
      local held = max(using, new)
      local bnew = min(floor(B * new / A), max(B - s.burst, 0))
      local bheld = max(floor(B * using / A), bnew)
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
  end
  return a
end

if op == 'G' then
  -- Refresh: the shares of one backend's scopes, or of several backends' (a refresh
  -- group's) in one call. ARGV[6] the number of parts; each part: its replica, the
  -- lifetime of its shares and of its semaphores' shares, its number of keys, then per
  -- key as `refresh` reads them.
  local a, k = 7, 1
  for _ = 1, tonumber(ARGV[6]) do
    me, life, plife = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local n = tonumber(ARGV[a + 3])
    a = refresh(k, n, a + 4)
    k = k + n
  end
  return out
elseif op == 'P' or op == 'Q' then
  -- Take from the pools, all or nothing: per key A, P, B and the units. Answers 1 and per
  -- key the wait until its pool holds a unit again, or 0, the blocking key (from 1) and
  -- its wait in us (-1: no rate is free of shares).
  -- A window takes from the units no replica holds; refused, its wait is -2 when the
  -- window itself is spent (the caller knows when it ends).
  -- Q, for one rate's key, books what P would refuse when the pool refills it within a
  -- lifetime: answers 2 and the wait (see below). ARGV[5] is then how long at least a
  -- booking is held once it is due.
  local a, ss = 6, {}
  local blocked, wait = 0, 0
  for k = 1, #KEYS do
    local A, P, B, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    local spec = ARGV[a + 1]
    a = a + 4
    local s
    if B == -1 then
      s = wload(KEYS[k], A, spec)
      s.n = n
      if blocked == 0 and s.u + s.held + n > A then
        blocked = k
        if s.u + n > A then wait = -2 else wait = -1 end
      end
    else
      s = load(KEYS[k], A, B, P)
      s.n = n
      if blocked == 0 and s.p < n * P then
        blocked = k
        local free = A - s.rate
        if free > 0 then wait = floor((n * P - s.p + free - 1) / free) else wait = -1 end
      end
    end
    ss[k] = s
  end
  -- A booking: the units the pool refills next go to this replica, due at now + wait and
  -- held until `x`, recorded as a share of no rate whose burst is the units (the pool's
  -- own burst is that much smaller meanwhile, so the bursts still sum to B at most).
  -- Unused by `x`, they are lost. The pool pays them now, as a debt its refill repays by
  -- the time they are due: over every window the bound holds as if they were taken then.
  local booked = false
  if op == 'Q' and blocked == 1 and #KEYS == 1 and wait > 0 and wait <= life and not ss[1].w then
    local s, f = ss[1], me .. '~b'
    local old = s.e[f]
    local held = s.burst
    if old then held = held - old.b end
    if held + s.n <= s.B then
      local x = now + wait + max(wait, plife)
      s.burst = held + s.n
      s.p = s.p - s.n * s.P
      call('HSET', s.key, f, fmt('%.0f:%.0f:%.0f:0', 0, s.n, x))
      if x > s.last then s.last = x end
      booked = true
    end
  end
  for k = 1, #KEYS do
    local s = ss[k]
    if s.w then
      if blocked == 0 then s.u = s.u + s.n end
      wsave(s)
    else
      if blocked == 0 then s.p = s.p - s.n * s.P end
      save(s)
    end
  end
  if booked then
    out[#out + 1] = 2
    out[#out + 1] = wait
  elseif blocked == 0 then
    out[#out + 1] = 1
    -- Per key, the wait in us until its pool holds a unit again (0: it holds one; a
    -- window's is 0): the caller refuses locally until then, with no call.
    for k = 1, #KEYS do
      local s = ss[k]
      local w = 0
      if not s.w and s.p < s.P then
        local free = s.A - s.rate
        if free > 0 then w = floor((s.P - s.p + free - 1) / free) else w = -1 end
      end
      out[#out + 1] = w
    end
  else
    out[#out + 1] = 0
    out[#out + 1] = blocked
    out[#out + 1] = wait
  end
  return out
elseif op == 'S' then
  -- Settle with the pools: per key A, P, B and the units to give back (negative: to
  -- charge more).
  -- A window's settle counts in the window it names, or nowhere (a grant of a window
  -- that has ended is neither refunded nor charged).
  local a = 6
  for k = 1, #KEYS do
    local A, P, B, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    local spec = ARGV[a + 1]
    a = a + 4
    if B == -1 then
      local s = wload(KEYS[k], A, spec)
      -- (Nothing to settle in a table that is gone or of another window.)
      if not (s.stale or s.fresh) then
        s.u = s.u - n
        wsave(s, true)
      end
    else
      local s = load(KEYS[k], A, B, P)
      s.p = s.p + n * P
      save(s)
    end
  end
  return out
end
return redis.error_reply('unknown operation ' .. tostring(op))
