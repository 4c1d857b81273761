-- tower-limits-redis: the upstream accounts' script, after the members' table that
-- accounts.rs writes in front of it (see the module's docs). `a` acquires, `b` applies
-- a batch.
local call, floor, fmt, ceil = redis.call, math.floor, string.format, math.ceil
-- how long past its wait a turn is kept for a replica that does not come back, us
local GRACE = 50000
-- a limit's debt above now, ns (0 when it has none)
local function debt(k)
  local v = call('GET', k)
  if not v then return 0 end
  local d = (tonumber(v) - NOW) * 1000
  if d < 0 then return 0 end
  return d
end
-- writes a limit's debt back (or deletes it when none is left)
local function put(k, n)
  if n <= 0 then call('DEL', k) return end
  local us = ceil(n / 1000)
  call('SET', k, fmt('%.0f', NOW + us), 'PX', fmt('%.0f', ceil(us / 1000) + 2 + SLACK))
end
local function bench_ns(m)
  local b = call('GET', KEYS[M[m].b])
  if not b then return 0 end
  local w = (tonumber(b) - NOW) * 1000
  if w < 0 then return 0 end
  return w
end
-- every member evaluated for `cost`: the member to charge (0: none), its headroom, its
-- limits' debts, the wait until one would grant, and the member not benched that would
-- grant first with its wait (nil: none); the benches go to reply[3 + m]
local function choose(cost, reply)
  local best, bestf, wait, ds, wm, ww = 0, -1, -1, nil, nil, -1
  for m = 1, #M do
    local bw = bench_ns(m)
    reply[3 + m] = bw
    if bw > 0 then
      if wait < 0 or bw < wait then wait = bw end
    else
      local f, mw, fits, d = 2, 0, true, {}
      for i, l in ipairs(M[m].l) do
        local need = 1
        if l.c == 1 then need = cost end
        if need * l.iv > l.tol then fits = false end
        d[i] = debt(KEYS[l.k])
        local n = d[i] + need * l.iv
        if n > l.tol then
          if n - l.tol > mw then mw = n - l.tol end
        else
          local x = (l.tol - n) / l.tol
          if x < f then f = x end
        end
      end
      if fits then
        if mw > 0 then
          if wait < 0 or mw < wait then wait = mw end
          if ww < 0 or mw < ww then wm, ww = m, mw end
        elseif f > bestf then best, bestf, ds = m, f, d end
      end
    end
  end
  return best, bestf, ds, wait, wm, ww
end
-- when a request of `cost` could be granted, ns from now, behind the requests `ahead`
-- (each {cost, ns until it comes back}) served first in their order, each on the member
-- where it fits first; nil when no member can hold it
local function behind(ahead, cost)
  local ds = {}
  for m = 1, #M do
    if bench_ns(m) == 0 then
      ds[m] = {}
      for i, l in ipairs(M[m].l) do ds[m][i] = debt(KEYS[l.k]) end
    end
  end
  local function serve(c, from, charge_it)
    local bm, bt = nil, nil
    for m, d in pairs(ds) do
      local tm = from
      for i, l in ipairs(M[m].l) do
        local need = 1
        if l.c == 1 then need = c end
        if need * l.iv > l.tol then tm = nil break end
        local x = d[i] + need * l.iv - l.tol
        if x > tm then tm = x end
      end
      if tm and (bt == nil or tm < bt) then bm, bt = m, tm end
    end
    if bm and charge_it then
      for i, l in ipairs(M[bm].l) do
        local need = 1
        if l.c == 1 then need = c end
        ds[bm][i] = math.max(ds[bm][i], bt) + need * l.iv
      end
    end
    return bt
  end
  local t = 0
  for _, a in ipairs(ahead) do
    t = serve(a[1], math.max(t, a[2]), true) or t
  end
  -- a millisecond after the last ahead, so that its call reaches the script first
  if #ahead > 0 then t = t + 1000000 end
  return serve(cost, t, false)
end
-- this replica's part of each of its n tenants' fleet demand (`mine` of `total` plus
-- `mine`), and its weight among replicas: the sum of weight times part over the tenants
-- whose `counts` is positive (1 when none is)
local function parts(n, names, weights, mine, total, counts)
  local W, shares = 0, {}
  for k = 1, n do
    local d = mine[names[k]]
    local sum = (total[names[k]] or 0) + d
    local sh = 1
    if sum > 0 then sh = d / sum end
    shares[k] = sh
    if counts[k] > 0 then W = W + weights[k] * sh end
  end
  if W <= 0 then W = 1 end
  return W, shares
end
-- what the fleet was charged recently, per member, in slots of a tenth of the span the
-- upstream counts (a store with replaceable limits): fields 'm:slot:r' (requests) and
-- 'm:slot:c' (cost) of RECENT; a slot leaves once eleven are newer
local function record(m, requests, cost)
  if not LEARN then return end
  local slot = floor(NOW / SLOT)
  if requests ~= 0 then call('HINCRBY', RECENT, m .. ':' .. slot .. ':r', requests) end
  if cost ~= 0 then call('HINCRBY', RECENT, m .. ':' .. slot .. ':c', cost) end
  call('HDEL', RECENT, m .. ':' .. (slot - 11) .. ':r', m .. ':' .. (slot - 11) .. ':c')
  call('PEXPIRE', RECENT, fmt('%.0f', ceil(SLOT * 12 / 1000) + 1000 + SLACK))
end
-- what the fleet was charged on member m over the span (and the slot under way), in the
-- units limit l counts
local function recent(m, l)
  local slot, kind, sum = floor(NOW / SLOT), 'r', 0
  if l.c == 1 then kind = 'c' end
  for s = slot - 10, slot do
    local v = call('HGET', RECENT, m .. ':' .. s .. ':' .. kind)
    if v then sum = sum + tonumber(v) end
  end
  if sum < 0 then return 0 end
  return sum
end
local function charge(best, ds, cost)
  for i, l in ipairs(M[best].l) do
    local need = 1
    if l.c == 1 then need = cost end
    put(KEYS[l.k], ds[i] + need * l.iv)
  end
  record(best, 1, cost)
end
-- a reservation: the request is sent `w` ns from now on member m, and is charged now
-- exactly as an admission at that instant would be (each limit's arrival time moved to
-- it first), so the mirror's state, and its bound, are those of an admission then
local function reserve(m, cost, w)
  local d = {}
  for i, l in ipairs(M[m].l) do
    d[i] = debt(KEYS[l.k])
    if d[i] < w then d[i] = w end
  end
  charge(m, d, cost)
end
-- the members' limits replaced at run time (RedisAccounts::replace_member_limits): the
-- field 'm:i' of LEARNED is "when iv tol, declared iv and tol"; it counts only while the
-- limit is declared as it was then (a fleet restarted with another configuration starts
-- from its own)
if LEARN then
  for _, mm in ipairs(M) do
    for _, l in ipairs(mm.l) do l.div, l.dtol = l.iv, l.tol end
  end
  local learned = call('HGETALL', LEARNED)
  for j = 1, #learned, 2 do
    local m, i = string.match(learned[j], '^(%d+):(%d+)$')
    local at, iv, tol, div, dtol = string.match(learned[j + 1], '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
    local l = m and M[tonumber(m)] and M[tonumber(m)].l[tonumber(i)]
    if l and dtol and tonumber(div) == l.iv and tonumber(dtol) == l.tol then
      l.iv, l.tol = tonumber(iv), tonumber(tol)
    end
  end
end
-- a store that lost its state (see the module's docs): every member starts with its
-- bursts spent, when this replica reached Redis before; the first call of a new fleet
-- starts them full
if call('EXISTS', EPOCH) == 0 then
  if KNOWN then
    for m = 1, #M do
      for _, l in ipairs(M[m].l) do
        if debt(KEYS[l.k]) < l.tol then put(KEYS[l.k], l.tol) end
      end
    end
  end
  call('SET', EPOCH, fmt('%.0f', NOW))
  -- a new fleet's leases hand out the full bursts once, as the first grants' tokens
  if not KNOWN and LIFE > 0 then call('HSET', LEASES, 'u', WHOLE) end
  -- the leases were lost too: for one lifetime nobody is granted more than it says it
  -- may still be using
  if KNOWN and LIFE > 0 then call('SET', LOST, '1', 'PX', fmt('%.0f', ceil(LIFE / 1000) + 1 + SLACK)) end
end
-- one operation of a batch, 5 arguments from ARGV[i]: kind, member, then
--   kind 1 (adjust): requests delta, cost delta, unused
--   kind 2 (report): retry-after us (-1 none), remaining requests (-1), remaining tokens (-1)
--   kind 3 (lower) and 5 (raise): the limit's place, its new interval and tolerance
--     (ns), applied only if it moves the limit that way (a replica that learned late
--     does not undo what another learned since)
local function apply(i)
  local kind, m, x, y, z = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
  if M[m] and kind >= 3 then
    local l = M[m].l[x]
    if l and ((kind == 3 and y > l.iv) or (kind == 5 and y < l.iv)) then
      -- a lowered rate counts what its mirror holds at the new pace, and at least what
      -- the fleet was charged over the span the upstream counts, as if admitted back to
      -- back at the new pace from the span's start
      if kind == 3 then
        local d = debt(KEYS[l.k]) * y / l.iv
        local want = recent(m, l) * y - SLOT * 10000
        if want > d then d = want end
        if d > 0 then put(KEYS[l.k], d) end
      end
      call('HSET', LEARNED, m .. ':' .. x, fmt('%.0f %.0f %.0f %.0f %.0f', NOW, y, z, l.div, l.dtol))
      l.iv, l.tol = y, z
    end
  elseif M[m] then
    if kind == 1 then
      for _, l in ipairs(M[m].l) do
        local delta = x
        if l.c == 1 then delta = y end
        if delta ~= 0 then put(KEYS[l.k], debt(KEYS[l.k]) + delta * l.iv) end
      end
      record(m, x, y)
    else
      if x >= 0 then
        local until_us = NOW + x
        local cur = call('GET', KEYS[M[m].b])
        if not cur or tonumber(cur) < until_us then
          call('SET', KEYS[M[m].b], fmt('%.0f', until_us), 'PX', fmt('%.0f', ceil(x / 1000) + 1 + SLACK))
        end
      end
      for _, l in ipairs(M[m].l) do
        local rem = y
        if l.c == 1 then rem = z end
        if rem >= 0 then
          local d = debt(KEYS[l.k])
          local left = floor((l.tol - d) / l.iv)
          if rem < left then put(KEYS[l.k], l.tol - rem * l.iv) end
        end
      end
    end
  end
end
-- the settles and reports riding on an acquisition, applied before it: their number at
-- ARGV[i], then 5 arguments each (see apply)
local function ride(i)
  local k = tonumber(ARGV[i]) or 0
  for j = 0, k - 1 do apply(i + 1 + 5 * j) end
end
-- 'a': an acquisition. ARGV: cost, replica id, then the riders (see ride)
if ARGV[1] == 'a' then
  local cost, rid = tonumber(ARGV[2]), ARGV[3]
  ride(4)
  -- the turn: the first replica refused holds it until it is served (or it expires)
  local hold = call('GET', HOLD)
  if hold then
    local holder, until_us = string.match(hold, '^(.-):(%d+)$')
    if holder ~= rid and tonumber(until_us) > NOW then
      local reply = {0, NOW, (tonumber(until_us) - NOW) * 1000 - GRACE * 1000}
      if reply[3] < 1000000 then reply[3] = 1000000 end
      for m = 1, #M do reply[3 + m] = bench_ns(m) end
      reply[4 + #M] = 0
      return reply
    end
  end
  local reply = {0, NOW, 0}
  local best, bestf, ds, wait, wm, ww = choose(cost, reply)
  -- the reply ends with the ns until a reserved request may go (0: at once)
  reply[4 + #M] = 0
  if best == 0 and wm and ww <= AHEAD then
    reserve(wm, cost, ww)
    best, bestf, reply[4 + #M] = wm, 0, ww
  elseif best == 0 then
    reply[3] = wait
    if wait > 0 then
      local w = ceil(wait / 1000) + GRACE
      call('SET', HOLD, rid .. ':' .. fmt('%.0f', NOW + w), 'PX', fmt('%.0f', ceil(w / 1000) + 1 + SLACK))
    end
    return reply
  else
    charge(best, ds, cost)
  end
  if hold then call('DEL', HOLD) end
  reply[1] = best
  reply[3] = floor(bestf * 1000000)
  return reply
end
-- 'f': an acquisition of the fleet's fair share. ARGV: cost, replica id, the request's
-- tenant, its band, the number of bands and their minimum shares (percent), n, then n
-- quintuples (tenant, weight, requests waiting on this replica, requests waiting or in
-- flight on it, the bands it waits in: ",0,2,"), then the riders (see ride). The hash
-- FLEET holds per band b 'V:b' (the band's virtual time, cost per weight) and 'b:b' (its
-- deficit while it waits, for a band with a minimum share), and per replica id: 'f:b:id' its finish tag in band b
-- and when it was last served, 'w:id' the start tag it waits with, until when the wait
-- holds and its band, 'd:id' when it last reported, the bands it has work in and its
-- demand per tenant (JSON). The reply ends with the band this replica should dispatch
-- from next (-1: its own order) and the ns until a reserved request may go (0: at once).
if ARGV[1] == 'f' then
  local cost, rid, tenant, band, nb = tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
  local mins = {}
  for b = 0, nb - 1 do mins[b] = tonumber(ARGV[7 + b]) end
  local n = tonumber(ARGV[7 + nb])
  ride(8 + nb + 5 * n)
  local names, weights, waiting, inband, mine = {}, {}, {}, {}, {}
  local tag, mybands = ',' .. band .. ',', ','
  -- the bands with work fleet-wide and here, and those with a request at a gate
  local waits, here, gates = {}, {}, {}
  waits[band], here[band], gates[band] = true, true, true
  for k = 1, n do
    local j = 7 + nb + 5 * (k - 1)
    names[k], weights[k], waiting[k] = ARGV[j + 1], tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3])
    mine[names[k]] = tonumber(ARGV[j + 4])
    inband[k] = 0
    if string.find(ARGV[j + 5], tag, 1, true) then inband[k] = waiting[k] end
    for b in string.gmatch(ARGV[j + 5], '%d+') do
      b = tonumber(b)
      waits[b], here[b] = true, true
    end
  end
  for b = 0, nb - 1 do
    if here[b] then mybands = mybands .. b .. ',' end
  end
  local V, myF, others, total, D, tags, worked = 0, nil, {}, {}, {}, {}, {}
  local fband = 'f:' .. band .. ':' .. rid
  local all = call('HGETALL', FLEET)
  for j = 1, #all, 2 do
    local f, v = all[j], all[j + 1]
    local kind, id = string.sub(f, 1, 1), string.sub(f, 3)
    if kind == 'V' then
      tags['V' .. id] = tonumber(v)
      if tonumber(id) == band then V = tonumber(v) end
    elseif kind == 'b' then
      D[tonumber(id)] = tonumber(v)
    elseif kind == 'd' then
      local at, bands, json = string.match(v, '^(%S+) (%S+) (.*)$')
      if not json or tonumber(at) + LIVE < NOW then call('HDEL', FLEET, f)
      elseif id ~= rid then
        for name, d in pairs(cjson.decode(json)) do total[name] = (total[name] or 0) + d end
        for b in string.gmatch(bands, '%d+') do
          b = tonumber(b)
          waits[b] = true
          worked[b] = worked[b] or {}
          table.insert(worked[b], id)
        end
      end
    else
      local a, b, c, e = string.match(v, '^(%S+) (%S+) ?(%S*) ?(%S*)$')
      if kind == 'f' then
        if tonumber(b) + IDLE < NOW then call('HDEL', FLEET, f)
        else
          tags[id] = tonumber(a)
          if f == fband then myF = tonumber(a) end
        end
      elseif kind == 'w' then
        if tonumber(b) <= NOW then call('HDEL', FLEET, f)
        elseif id ~= rid then
          local ob = tonumber(c) or 0
          waits[ob], gates[ob] = true, true
          -- start tag, id, band, the cost it waits with, ns until it asks again
          local back = (tonumber(b) - GRACE - NOW) * 1000
          if back < 0 then back = 0 end
          others[#others + 1] = {tonumber(a), id, ob, tonumber(e) or cost, back}
        end
      end
    end
  end
  -- the band that goes, among those with a request at a gate: the one owed most (a
  -- deficit above zero, the first on a tie), else the first; a band with no work
  -- anywhere owes and is owed nothing
  local go, owed = nil, 0
  for b = 0, nb - 1 do
    if gates[b] then
      if go == nil then go = b end
      if (mins[b] or 0) > 0 and (D[b] or 0) > owed then owed = D[b] end
    end
    if not waits[b] and D[b] then
      call('HDEL', FLEET, 'b:' .. b)
      D[b] = nil
    end
  end
  if owed > 0 then
    for b = 0, nb - 1 do
      if gates[b] and (mins[b] or 0) > 0 and D[b] == owed then go = b break end
    end
  end
  if go == nil then go = band end
  -- its weight among replicas over its tenants waiting in the band
  local W, shares = parts(n, names, weights, mine, total, inband)
  local S = V
  if myF and myF > S then S = myF end
  -- start-time fair queuing among the replicas waiting in the band: the lowest start
  -- tag goes first
  -- the requests at other replicas' gates that go before this one: all those of the
  -- band that goes when it is not this one's, else those of this band with a lower
  -- start tag (the id breaks a tie)
  local ahead = {}
  for _, o in ipairs(others) do
    local t = o[1]
    if o[3] == band and t < V then t = V end
    if (go ~= band and o[3] == go) or (go == band and o[3] == band and (t < S or (t == S and o[2] < rid))) then
      ahead[#ahead + 1] = {t, o[2], o[4], o[5]}
    end
  end
  table.sort(ahead, function(x, y) return x[1] < y[1] or (x[1] == y[1] and x[2] < y[2]) end)
  local blocked = go ~= band or #ahead > 0
  local reply = {0, NOW, 0}
  local best, bestf, ds, wait, wm, ww = choose(cost, reply)
  local granted = best ~= 0 and not blocked
  -- first in line, no room yet, but room within AHEAD: reserved (sent at its instant)
  local delay = 0
  if not blocked and best == 0 and wm and ww <= AHEAD then
    granted, delay, best, bestf = true, ww, wm, 0
  end
  if granted then
    if delay > 0 then reserve(best, cost, delay) else charge(best, ds, cost) end
    if S > V then call('HSET', FLEET, 'V:' .. band, fmt('%.17g', S)) end
    call('HSET', FLEET, fband, fmt('%.17g', S + cost / W) .. ' ' .. fmt('%.0f', NOW))
    tags[band .. ':' .. rid] = S + cost / W
    -- every band waiting with a minimum share is owed it of this cost, less what it got
    for b = 0, nb - 1 do
      if waits[b] and (mins[b] or 0) > 0 then
        local d = (D[b] or 0) + cost * mins[b] / 100
        if b == band then d = d - cost end
        D[b] = d
        call('HSET', FLEET, 'b:' .. b, fmt('%.17g', d))
      end
    end
    -- still backlogged: it keeps its place (its next start tag) while its next request
    -- comes, for GRACE at most, so that the replica served most is not skipped between
    -- its calls
    local more = -1
    for k = 1, n do more = more + waiting[k] end
    if more > 0 then
      call('HSET', FLEET, 'w:' .. rid, fmt('%.17g', S + cost / W) .. ' ' .. fmt('%.0f', NOW + GRACE) .. ' ' .. band .. ' ' .. cost)
    else
      call('HDEL', FLEET, 'w:' .. rid)
    end
    reply[1] = best
    reply[3] = floor(bestf * 1000000)
  else
    -- another replica's (or band's) turn: look again once those ahead could have been
    -- served, each when it asks again, and this one after them; without room and
    -- nobody ahead, when this one fits
    if blocked then
      local queue = {}
      for k, a in ipairs(ahead) do queue[k] = {a[3], a[4]} end
      local at = behind(queue, cost)
      if at and at > wait then wait = at end
    end
    if wait < BLOCKED then wait = BLOCKED end
    reply[3] = wait
    call('HSET', FLEET, 'w:' .. rid, fmt('%.17g', S) .. ' ' .. fmt('%.0f', NOW + ceil(wait / 1000) + GRACE) .. ' ' .. band .. ' ' .. cost)
  end
  local report = {}
  for k = 1, n do
    if mine[names[k]] > 0 then report[names[k]] = mine[names[k]] end
    reply[3 + #M + k] = floor(shares[k] * 1024 + 0.5)
  end
  call('HSET', FLEET, 'd:' .. rid, fmt('%.0f', NOW) .. ' ' .. mybands .. ' ' .. cjson.encode(report))
  call('PEXPIRE', FLEET, 60000 + SLACK)
  -- the band to dispatch from next: a band owed its share is dispatched by the replica
  -- with work in it whose finish tag there is lowest (one at a time, so that no other
  -- replica holds a request of it waiting); otherwise the first band with work here
  local next = -1
  if nb > 1 then
    local owedb = nil
    for b = 0, nb - 1 do
      if waits[b] and (mins[b] or 0) > 0 and (D[b] or 0) > 0 and (owedb == nil or D[b] > D[owedb]) then owedb = b end
    end
    if owedb and here[owedb] then
      local vb = tags['V' .. owedb] or 0
      local mine_t = math.max(tags[owedb .. ':' .. rid] or vb, vb)
      local chosen = true
      for _, id in ipairs(worked[owedb] or {}) do
        local t = math.max(tags[owedb .. ':' .. id] or vb, vb)
        if t < mine_t or (t == mine_t and id < rid) then chosen = false break end
      end
      if chosen then next = owedb end
    end
    if next < 0 then
      for b = 0, nb - 1 do
        if here[b] and (b ~= owedb or not owedb) then next = b break end
      end
    end
  end
  reply[3 + #M + n + 1] = next
  reply[3 + #M + n + 2] = delay
  return reply
end
-- 'l': a lease refresh (accounts/lease.rs). ARGV: replica id, the rate fraction and the
-- burst fraction it may still be using, the most rate it could use (its cap), the least
-- burst part that holds its largest request, the part of the bursts it dropped as tokens
-- since its last report (fractions in millionths), the number of bands and their
-- minimum shares, then n and n quintuples as for 'f'. The hash LEASES
-- keeps per replica 'r:<id>' = "rate granted, rate reported, burst granted, burst
-- reported, expires, cap, weights per band (comma-separated), least part, period, next
-- refresh" (the period it was given and when it comes back, us), 'd:<id>' =
-- its demand per tenant (JSON), and 'u' = the part of the bursts no lease holds as tokens
-- (a new fleet's full bursts, and what shrunk parts dropped), handed out with the parts
-- that grow. The reply: the rate and burst granted, the
-- part of the bursts given as tokens, the members' benches, the caller's part of each
-- tenant's demand (of 1024), each band's part of what the caller holds (millionths),
-- every member's limits, interval and tolerance (ns), when to ask again (ns, 0: at the
-- next period) and the period until the next refresh (ns): REFRESH while anything in the
-- fleet moves, doubling up to CALM while every live replica holds what it is allotted.
if ARGV[1] == 'l' then
  local rid, ug, uh, cap = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  local q, back, given = math.max(tonumber(ARGV[6]), QMIN), tonumber(ARGV[7]), tonumber(ARGV[8])
  local mins = {}
  for b = 0, given - 1 do mins[b] = tonumber(ARGV[9 + b]) end
  local nb, n = math.max(given, 1), tonumber(ARGV[9 + given])
  local names, weights, mine, bandsof = {}, {}, {}, {}
  for k = 1, n do
    local j = 9 + given + 5 * (k - 1)
    names[k], weights[k] = ARGV[j + 1], tonumber(ARGV[j + 2])
    mine[names[k]] = tonumber(ARGV[j + 4])
    bandsof[k] = ARGV[j + 5]
  end
  local reps, demand, before, held, unspent, pv = {}, {}, nil, 0, 0, 0
  local all = call('HGETALL', LEASES)
  for j = 1, #all, 2 do
    local f, v = all[j], all[j + 1]
    local kind, id = string.sub(f, 1, 1), string.sub(f, 3)
    if kind == 'r' then
      local g, r, hg, hr, e, c, w, oq, op, nx =
        string.match(v, '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+)$')
      if not e or tonumber(e) <= NOW then call('HDEL', LEASES, f, 'd:' .. id)
      else
        local ws = {}
        local b = 0
        for x in string.gmatch(w, '[^,]+') do ws[b], b = tonumber(x), b + 1 end
        if id ~= rid then
          reps[id] = {g = tonumber(g), r = tonumber(r), hg = tonumber(hg), hr = tonumber(hr), c = tonumber(c),
            ws = ws, q = tonumber(oq), e = tonumber(e), nx = tonumber(nx), per = tonumber(op)}
        else
          before, held, pv = ws, math.max(tonumber(hg), tonumber(hr)), tonumber(op)
        end
      end
    elseif kind == 'd' and id ~= rid then demand[id] = v
    elseif f == 'u' then unspent = tonumber(v) end
  end
  local total = {}
  for id, v in pairs(demand) do
    if reps[id] then
      for name, d in pairs(cjson.decode(v)) do total[name] = (total[name] or 0) + d end
    end
  end
  -- its weight among replicas in each band, over the tenants with demand there
  local demanded = {}
  for k = 1, n do demanded[k] = mine[names[k]] end
  local _, shares = parts(n, names, weights, mine, total, demanded)
  local ws = {}
  for b = 0, nb - 1 do
    local w, tag = 0, ',' .. b .. ','
    for k = 1, n do
      local first = nb == 1 or bandsof[k] == ','
      if demanded[k] > 0 and (string.find(bandsof[k], tag, 1, true) or (b == 0 and first)) then
        w = w + weights[k] * shares[k]
      end
    end
    -- smoothed: a count of requests waiting swings from one refresh to the next, and
    -- every part that moves between replicas is idle from the giver's confirmation to
    -- the taker's refresh; a band that had no weight here counts at once (a replica's
    -- first requests, or its first after a quiet spell, would otherwise ramp over five
    -- periods behind the others)
    if before and (before[b] or 0) > 0 then w = before[b] + SMOOTH * (w - before[b]) end
    ws[b] = w
  end
  -- the bands' parts of the rate: each later band with work its minimum share, the first
  -- band with work the rest; a replica's weight is its part of each band's weight
  local sums = {}
  for b = 0, nb - 1 do sums[b] = ws[b] end
  for _, o in pairs(reps) do
    if o.c > 0 then
      for b = 0, nb - 1 do sums[b] = sums[b] + (o.ws[b] or 0) end
    end
  end
  local part, first = {}, nil
  for b = 0, nb - 1 do
    if sums[b] > 0 then
      if first == nil then first = b else part[b] = (mins[b] or 0) / 100 end
    end
  end
  if first then
    part[first] = 1
    for b, p in pairs(part) do if b ~= first then part[first] = part[first] - p end end
    if part[first] < 0 then part[first] = 0 end
  end
  -- (without demand anywhere, the replicas weigh the same; one without demand, a little)
  local function weight(wsr)
    if first == nil then return 1 end
    local w = 0
    for b, p in pairs(part) do w = w + p * (wsr[b] or 0) / sums[b] end
    if w > 0 then return w end
    return 0.001
  end
  local W = weight(ws)
  -- the rate: weighted max-min fairness over the live replicas' caps, among the replicas
  -- whose least usable parts of the bursts fit together (the heaviest first)
  local cand = {}
  for id, o in pairs(reps) do
    if o.c > 0 then cand[#cand + 1] = {id = id, c = o.c, w = weight(o.ws), q = o.q} end
  end
  if cap > 0 then cand[#cand + 1] = {id = rid, c = cap, w = W, q = q} end
  table.sort(cand, function(a, b) if a.w ~= b.w then return a.w > b.w end return a.id < b.id end)
  local act, qsum = {}, 0
  for _, a in ipairs(cand) do
    if qsum + a.q <= WHOLE then
      act[#act + 1] = a
      qsum = qsum + a.q
    end
  end
  local left, allots = WHOLE, {}
  while #act > 0 do
    local sw = 0
    for _, a in ipairs(act) do sw = sw + a.w end
    local used, rest = 0, {}
    for _, a in ipairs(act) do
      if a.c <= left * a.w / sw then
        used = used + a.c
        allots[a.id] = a.c
      else
        rest[#rest + 1] = a
      end
    end
    if #rest == #act then
      for _, a in ipairs(act) do allots[a.id] = left * a.w / sw end
      break
    end
    left = left - used
    act = rest
  end
  local allot = allots[rid] or 0
  -- the burst: its least usable part for each holder, the rest by rate
  local hallot = 0
  if allot > 0 then hallot = q + (WHOLE - qsum) * allot / WHOLE end
  local og, oh = 0, 0
  for _, o in pairs(reps) do
    og = og + math.max(o.g, o.r)
    oh = oh + math.max(o.hg, o.hr)
  end
  -- a part within DEAD of the one held stays as it is: moving it costs more than it mends
  -- (a part that grows into what no replica holds moves nobody's: it grows, else the
  -- difference would be nobody's until the allotments move)
  if math.abs(allot - ug) < DEAD and ug <= WHOLE - og and (allot < ug or allot > WHOLE - og) then allot = ug end
  local g = floor(math.min(allot, WHOLE - og))
  -- short of its allotment while another holds more than its own, told to give part
  -- back or to be told at its next refresh: ask again just after that one's next refresh
  -- (or its confirmation, for a large part), not at this one's next period
  local soon = 0
  if allot - g > DEAD then
    for id, o in pairs(reps) do
      local over = math.max(o.g, o.r) - (allots[id] or 0)
      if o.r - o.g > DEAD or over > DEAD then
        -- (it comes back when its last answer said, or, that past, at its period)
        local next = o.nx - NOW
        if next <= 0 then next = o.e - LIFE + o.per - NOW end
        -- one that gives a large part back confirms at once (below)
        if o.r - o.g > LARGE and o.e - LIFE + CONFIRM > NOW then next = o.e - LIFE + CONFIRM - NOW
        elseif o.r - o.g <= DEAD and over > LARGE then next = next + CONFIRM end
        if next > 0 and next < CALM and (soon == 0 or next < soon) then soon = next end
      end
    end
  end
  -- allotted a tenth of the whole or more and granted nothing (a fleet starting, or work
  -- that moved here), it looks again a tenth of a period on at the latest: the holders
  -- may give their parts back before the refresh it was told of (one that refreshes early
  -- gives a large part back at once, below), and it would not hear of it
  if g <= 0 and allot > LARGE and (soon == 0 or soon > REFRESH / 10) then soon = floor(REFRESH / 10) end
  -- told to give a large part back (a tenth of the whole or more: a fleet starting, or
  -- work that moved) while others wait for capacity: ask again at once, so that the part
  -- is free for them one call later rather than one period
  if ug - math.min(g, ug) > LARGE then
    for _, o in pairs(reps) do
      if o.c >= WHOLE then soon = 1 break end
    end
  end
  -- took a large part in this call (a fleet starting, or work that moved here): others
  -- may be waiting for some of it; look again a tenth of a period on
  if soon == 0 and g - ug >= LARGE then soon = floor(REFRESH / 10) end
  local h = floor(math.min(hallot, WHOLE - oh))
  -- a burst too small to hold the replica's requests would refuse them
  if g <= 0 or h < q then g, h = 0, 0 end
  local lost = call('EXISTS', LOST) == 1
  if lost then
    if g > ug then g = ug end
    if h > uh then h = uh end
    if h < q then g, h = 0, 0 end
  end
  -- settled: the caller keeps what it holds and is allotted no more, and every other
  -- live replica that wants capacity holds some, holds its allotment and has confirmed
  -- it; then nothing moves until some replica's demand does (that replica refreshes at
  -- once, see lease.rs), and the period doubles up to CALM; anything else brings it back
  -- to REFRESH
  local period = REFRESH
  local settled = soon == 0 and g > 0 and math.abs(g - ug) <= SETTLE and math.abs(h - uh) <= SETTLE
    and allot - g <= SETTLE and not lost
  if settled then
    for id, o in pairs(reps) do
      local a = allots[id] or 0
      -- (one that wants capacity and holds none waits for parts to move: not settled)
      if o.c > 0 and (o.r - o.g > SETTLE or math.abs(a - o.g) > SETTLE or math.max(o.g, o.r) == 0) then
        settled = false
        break
      end
    end
  end
  if settled then period = math.min(CALM, math.max(REFRESH, 2 * pv)) end
  local wtext = {}
  for b = 0, nb - 1 do wtext[b + 1] = fmt('%.17g', ws[b]) end
  call('HSET', LEASES, 'r:' .. rid,
    fmt('%.0f %.0f %.0f %.0f %.0f %.0f %s %.0f %.0f %.0f', g, ug, h, uh, NOW + LIFE, cap, table.concat(wtext, ','), q,
      period, NOW + (soon > 0 and soon or period)))
  local report = {}
  for k = 1, n do
    if mine[names[k]] > 0 then report[names[k]] = mine[names[k]] end
  end
  call('HSET', LEASES, 'd:' .. rid, cjson.encode(report))
  call('PEXPIRE', LEASES, fmt('%.0f', ceil(LIFE / 1000) + 60000 + SLACK))
  -- the part of the bursts no lease ever held comes with the part's growth as tokens:
  -- it stays at most the part nobody is counted for, so the tokens held and the bursts
  -- not handed out never sum to more than the bursts
  -- tokens a replica's shrunk burst part dropped come back to the part no lease holds as
  -- tokens, for a part that grows to take (a new fleet's first grab, given back moments
  -- later, would otherwise lose the bursts)
  if back > 0 then
    unspent = math.min(WHOLE, unspent + back)
    call('HSET', LEASES, 'u', fmt('%.0f', unspent))
  end
  local gift = 0
  if unspent > 0 then
    gift = math.max(0, math.min(unspent, math.max(h, uh) - held, h))
    if gift > 0 then call('HSET', LEASES, 'u', fmt('%.0f', unspent - gift)) end
  end
  local reply = {g, h, gift}
  for m = 1, #M do reply[3 + m] = bench_ns(m) end
  for k = 1, n do reply[3 + #M + k] = floor(shares[k] * 1024 + 0.5) end
  -- each band's part of what the caller holds (millionths): its local queue keeps that
  -- minimum share for the band, not the configured share of everything it holds
  for b = 0, given - 1 do
    local owed = 0
    if part[b] and b ~= first and sums[b] > 0 and W > 0 then
      owed = math.min(WHOLE, floor(WHOLE * part[b] * ws[b] / sums[b] / W + 0.5))
    end
    reply[3 + #M + n + b + 1] = owed
  end
  -- the members' limits as the fleet holds them (replaced ones included), then when to
  -- ask again (ns from now; 0: at the next period)
  local at = 3 + #M + n + given
  for m = 1, #M do
    for _, l in ipairs(M[m].l) do
      reply[at + 1], reply[at + 2] = l.iv, l.tol
      at = at + 2
    end
  end
  reply[at + 1] = soon * 1000
  reply[at + 2] = period * 1000
  return reply
end
-- 'b': a batch of operations (see apply)
local i = 2
while i + 4 <= #ARGV do
  apply(i)
  i = i + 5
end
-- a store whose limits may be replaced learns when none is on record (Redis lost them)
if LEARN and call('EXISTS', LEARNED) == 0 then return -1 end
return 1
