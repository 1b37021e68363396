-- sluice's shared limits (src/cluster/): one call reserves, on Redis's clock and
-- atomically, the earliest instant at which every global limit of a request admits it.
-- A limit's parameters come with each call, so a reload that changes them needs no
-- migration. Instants are microseconds of Redis TIME.
--
-- Each reserved request counts as reaching the provider between its instant T and
-- T + margin; a replica later corrects that with what it saw (the request went out late,
-- or was answered sooner, or never went out).
--
-- KEYS[1]           the partition's epoch: a new one means Redis lost what it held
-- KEYS[2k], [2k+1]  limit k's state and a second key (a fixed window's opening; a
--                   GCRA's last reservation, "member before latest", so that a
--                   correction of it can be folded in again)
-- KEYS[2n+2]        the partition's run: "replica count queued", who reserved last, how
--                   many in a row, and how many of its requests were waiting behind
-- KEYS[2n+3]        the partition's claims: replica -> "since due", replicas told to
--                   come back (status 4), since when, and when they come back
-- ARGV[1]  op: "reserve", "settle" (a reserve that never answers 4), "flush"
--          (corrections only) or "absorb" (write back)
-- ARGV[2]  now in microseconds; "" for Redis TIME (tests drive the clock)
-- ARGV[3]  the epoch the caller last saw ("" for none)
-- ARGV[4]  an epoch to set if there is none
-- ARGV[5]  this reservation's id, "replica:sequence", a member of the windows' sets
-- ARGV[6]  horizon: an instant further away is not reserved (us)
-- ARGV[7]  max wait: an instant further away than this is refused (us)
-- ARGV[8]  how many requests of the caller's family wait behind this one on its replica
-- ARGV[9]  n, the number of limits; then 7 per limit: kind, a, b, c, margin (us), pays,
--          weight
--            "s" sliding window, "f" fixed window from the first request: a = permits,
--                b = window (us)
--            "k" fixed window on the clock: a = permits, b = window (us), c = where
--                windows start past whole windows since the Unix epoch (us)
--            "c" sliding window counter, "u" one the provider compares unrounded:
--                a = permits, b = window (us), c = the offset as for "k", or "any"
--                when the provider's windows may fall anywhere
--            "t" GCRA (token bucket, leaky bucket, published): a = emission interval
--                (us), b = tolerance
--            pays: "1" if this reservation pays the limit, "0" if it is only here for
--            its corrections
--            weight: "" for a limit of requests (each counts one); else the limit counts
--            a unit (tokens, points) and this reservation pays that many. A member of
--            such a limit is named "id*w" when it weighs w other than 1 ("Weights").
-- then     c, the number of corrections; 4 each: limit (1-based), member as last named,
--            value: "" the request never went out, "k" kept, else the latest instant it
--            may have arrived; weight: "" kept, else "w s": the request really cost w,
--            as its response said at s (us; the provider reconciled by then)

-- absorb:  then per limit: windows: count, for a fixed window its opening, then count
--          (member, value) pairs; token buckets: the replica's own debt (us)
--
-- Returns {status, us, epoch, now, flags, yield, opening of each limit}: status 0
-- reserved, `us` from now; 1 further than the horizon, not reserved; 2 further than max
-- wait; 3 the epoch changed, nothing done; 4 not reserved: come back `us` from now (see
-- "Turns"). flags, with status 0: "c" when the next request would wait on this one's
-- answer (the replica asks for it once the answer is in), "w" when other replicas wait
-- for their turn (the answer's correction should come at once); yield: the replica's
-- next request comes back this many us from now (its run is over), or 0.

-- Weights. A limit of requests counts each member once. A limit of a unit counts each
-- member by its weight, carried in its name so that a window's sorted set holds it with
-- no other key: "id*1200". A response that reports the true cost renames the member,
-- keeping its instant, so a sliding log's entry shrinks or grows; a GCRA's instant moves
-- by the difference times its emission interval.

local op = ARGV[1]
-- Numbers go to Redis as strings: Lua would print a microsecond instant with 14 digits.
local function num(x) return string.format('%.3f', x) end
local now
if ARGV[2] ~= '' then
  now = tonumber(ARGV[2])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local DAY = 86400000

local epoch = redis.call('GET', KEYS[1])
if not epoch then
  epoch = ARGV[4]
  redis.call('SET', KEYS[1], epoch, 'PX', DAY)
else
  redis.call('PEXPIRE', KEYS[1], DAY)
end
if op ~= 'absorb' and ARGV[3] ~= '' and ARGV[3] ~= epoch then
  return {3, 0, epoch, num(now)}
end

local n = tonumber(ARGV[9])
local L = {}
local i = 10
for k = 1, n do
  L[k] = {kind = ARGV[i], a = tonumber(ARGV[i + 1]), b = tonumber(ARGV[i + 2]),
          off = tonumber(ARGV[i + 3]), m = tonumber(ARGV[i + 4]), pays = ARGV[i + 5] == '1',
          weighted = ARGV[i + 6] ~= '', w = tonumber(ARGV[i + 6]) or 1,
          key = KEYS[2 * k], aux = KEYS[2 * k + 1]}
  L[k].counter = L[k].kind == 'c' or L[k].kind == 'u'
  -- How long after its latest arrival an entry still counts.
  L[k].span = L[k].counter and 2 * L[k].b or L[k].b
  i = i + 7
end

-- A member's weight, from its name.
local function wof(member)
  local w = string.match(member, '%*(%d+)$')
  return w and tonumber(w) or 1
end

-- A member's name at weight w.
local function named(member, w)
  local id = string.match(member, '^(.-)%*%d+$') or member
  if w == 1 then return id end
  return id .. '*' .. string.format('%d', w)
end

-- The weight of l's members scored from `since` on (a ZRANGEBYSCORE bound).
local function weight_from(l, since)
  if not l.weighted then return redis.call('ZCOUNT', l.key, since, '+inf') end
  local total = 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', l.key, since, '+inf')) do
    total = total + wof(m)
  end
  return total
end

-- A sorted set's smallest score, or nil.
local function lowest(key)
  local r = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if #r == 0 then return nil end
  return tonumber(r[2])
end

-- A number stored at key, or nil.
local function stored(key)
  local v = redis.call('GET', key)
  if v then return tonumber(v) end
  return nil
end

-- Keeps a key a while past the last instant it matters.
local function ttl(until_us)
  return string.format('%d', math.max(1, math.ceil((until_us - now) / 1000)) + 60000)
end
local function keep(key, until_us)
  redis.call('PEXPIRE', key, ttl(until_us))
end
-- Sets a key, kept a while past the last instant it matters.
local function put(key, value, until_us)
  redis.call('SET', key, value, 'PX', ttl(until_us))
end

-- The start of the clock window holding t.
local function edge(l, t)
  return t - ((t - l.off) % l.b)
end

-- Forgets what time has made irrelevant: window entries a window past their latest
-- arrival (two for a counter), a fixed window the provider has surely closed, clock
-- windows before the current one.
local function expire(l)
  if l.kind == 's' or l.counter then
    redis.call('ZREMRANGEBYSCORE', l.key, '-inf', num(now - l.span))
  elseif l.kind == 'k' then
    redis.call('ZREMRANGEBYSCORE', l.key, '-inf', '(' .. num(edge(l, now)))
  elseif l.kind == 'f' then
    local hi = lowest(l.key)
    if not hi or now >= hi + l.b then
      redis.call('DEL', l.key, l.aux)
    end
  end
end

for k = 1, n do expire(L[k]) end

if op == 'absorb' then
  -- A replica writes back its own admissions still inside their windows. What the other
  -- replicas admitted is not known here until they write theirs back, so the limits
  -- start drained: a window is filled up to its limit with placeholders that may have
  -- reached the provider just now, a bucket is emptied.
  for k = 1, n do
    local l = L[k]
    if l.kind == 't' then
      local debt = tonumber(ARGV[i]); i = i + 1
      local tat = math.max(stored(l.key) or now, now) + debt
      tat = math.max(tat, now + l.m + l.b + l.a)
      redis.call('SET', l.key, num(tat))
      -- Its last reservation is no longer the last thing folded in.
      redis.call('DEL', l.aux)
      keep(l.key, tat)
    else
      local count = tonumber(ARGV[i]); i = i + 1
      local opening = now
      if l.kind == 'f' then
        opening = tonumber(ARGV[i]) or 0; i = i + 1
        if opening <= 0 then opening = now end
      end
      -- A fixed window's opening is unknown now: it may have opened just now.
      local floor = (l.kind == 'f') and (now + l.m) or 0
      for j = 1, count do
        local v = math.max(tonumber(ARGV[i + 1]), floor)
        if v + l.span > now then
          redis.call('ZADD', l.key, 'NX', num(v), ARGV[i])
        end
        i = i + 2
      end
      if l.kind == 'f' then
        local cur = stored(l.aux)
        redis.call('SET', l.aux, num(math.min(cur or opening, opening, now)))
      end
      -- Windows on the clock and counters are full while `a` entries may arrive now.
      local since = (l.kind == 's' or l.kind == 'f') and '(' .. num(now - l.b) or num(now)
      local alive = weight_from(l, since)
      if l.weighted and alive < l.a then
        redis.call('ZADD', l.key, 'NX', num(now + l.m), named('drained:' .. ARGV[4], l.a - alive))
      elseif not l.weighted then
        for j = alive + 1, l.a do
          redis.call('ZADD', l.key, 'NX', num(now + l.m), 'drained:' .. ARGV[4] .. ':' .. j)
        end
      end
      local last = redis.call('ZRANGE', l.key, -1, -1, 'WITHSCORES')
      local until_us = tonumber(last[2] or now) + l.span
      keep(l.key, until_us)
      if l.kind == 'f' then keep(l.aux, until_us) end
    end
  end
  return {0, 0, epoch, num(now)}
end

-- A GCRA's last reservation, as its aux key holds it: "member before latest w settled",
-- where `settled` is the latest arrival of the reservations before it.
local function last_of(l)
  local last = redis.call('GET', l.aux)
  if not last then return nil end
  local who, before, latest, w, settled =
    string.match(last, '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
  if not who then return nil end
  return {who = who, before = tonumber(before), latest = tonumber(latest), w = tonumber(w),
          settled = tonumber(settled)}
end
local function set_last(l, r, until_us)
  put(l.aux, r.who .. ' ' .. num(r.before) .. ' ' .. num(r.latest) .. ' ' ..
      string.format('%d', r.w) .. ' ' .. num(r.settled), until_us)
end
local function set_tat(l, tat)
  if tat > 0 then put(l.key, num(tat), tat) else redis.call('DEL', l.key) end
end

local c = tonumber(ARGV[i]); i = i + 1
for j = 1, c do
  local l = L[tonumber(ARGV[i])]
  local member, v, cw = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  i = i + 4
  local was = wof(member)
  local cost, said = string.match(cw, '^(%d+) (%S+)$')
  local w = tonumber(cost) or was
  -- When the provider gave back or charged the difference: no later than this.
  said = math.min(tonumber(said) or now, now)
  if l and l.kind ~= 't' then
    if v == '' then
      redis.call('ZREM', l.key, member)
    elseif w ~= was then
      -- Renamed at its new weight, at the instant given or the one it had.
      local at = tonumber(v) or tonumber(redis.call('ZSCORE', l.key, member) or '')
      if at and redis.call('ZREM', l.key, member) == 1 then
        redis.call('ZADD', l.key, num(at), named(member, w))
        keep(l.key, at + l.span)
      end
    elseif v ~= 'k' then
      redis.call('ZADD', l.key, 'XX', v, member)
      keep(l.key, tonumber(v) + l.span)
    end
  elseif l then
    local r = last_of(l)
    local tat = stored(l.key)
    if r and r.who == member then
      -- The last reservation is folded in again: at its new instant and weight.
      if v == '' then
        redis.call('DEL', l.aux)
        tat = r.before
      else
        r.latest = tonumber(v) or r.latest
        r.who, r.w = named(member, w), w
        local folded = math.max(r.before, r.latest) + w * l.a
        -- A refund does not bring the bucket back past full.
        if w < was and tat then folded = math.max(folded, math.min(now, tat)) end
        tat = folded
        set_last(l, r, tat)
      end
      set_tat(l, tat)
    elseif tat and w > was then
      -- Later reservations were folded on top: a charge goes on top of them too.
      set_tat(l, tat + (w - was) * l.a)
    elseif tat and w < was and not (r and r.settled > said) then
      -- A refund, unless a reservation before the last may have been on its way when the
      -- provider gave it back (it counted that one later, over the refund).
      local back = (was - w) * l.a
      local function refund(x) return math.max(x - back, math.min(now, x)) end
      if r and r.latest > said then
        -- The last may have been on its way: the refund goes under it.
        r.before = refund(r.before)
        tat = math.max(r.before, r.latest) + r.w * l.a
        set_last(l, r, tat)
      else
        tat = refund(tat)
      end
      set_tat(l, tat)
    end
  end
end
-- A corrected entry may have left its window; an emptied fixed window is no window.
for k = 1, n do expire(L[k]) end
if op == 'flush' then
  return {0, 0, epoch, num(now)}
end

-- A provider that reads its clock to the millisecond may see an arrival up to that much
-- earlier in its window: the previous window's weight allows for it (us).
local GRAIN = 1000

-- The previous window's weight at x into the current one, times the window.
local function weight(l, x)
  return l.b - math.min(l.b, math.max(0, x - GRAIN))
end

-- How many of the ascending `scores` are below x.
local function below(scores, x)
  local lo, hi = 0, #scores
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if scores[mid] < x then lo = mid else hi = mid - 1 end
  end
  return lo
end

-- A counter's estimate at t, times the window, from its entries' latest arrivals
-- (ascending): an entry not yet past counts fully, one in the current window fully,
-- one in the previous window by its weight. At any alignment, the largest estimate
-- over every placement of the edges: it is at x = 0 or where an entry enters the
-- current window (x = d) or the previous one (x = d - window).
local function estimate(l, scores, ws, t)
  if l.off then
    -- Edges known: count either side of them. `upto[k]`: the weight of the first k.
    local upto = {[0] = 0}
    for j = 1, #scores do upto[j] = upto[j - 1] + ws[j] end
    local x = (t - l.off) % l.b
    local start = t - x
    local cur = upto[#scores] - upto[below(scores, start)]
    local prev = upto[below(scores, start)] - upto[below(scores, start - l.b)]
    return cur * l.b + prev * weight(l, x)
  end
  local full, ds, dw = 0, {}, {}
  for j = #scores, 1, -1 do
    local at = scores[j]
    if at >= t then
      full = full + ws[j]
    elseif t - at < 2 * l.b then
      ds[#ds + 1] = t - at
      dw[#dw + 1] = ws[j]
    end
  end
  local xs = {0}
  for _, d in ipairs(ds) do
    xs[#xs + 1] = (d < l.b) and d or (d - l.b)
  end
  table.sort(xs)
  local best, i, j, cur, upto = 0, 1, 1, 0, 0
  for _, x in ipairs(xs) do
    while i <= #ds and ds[i] <= x do cur = cur + dw[i]; i = i + 1 end
    while j <= #ds and ds[j] <= x + l.b do upto = upto + dw[j]; j = j + 1 end
    local v = cur * l.b + (upto - cur) * weight(l, x)
    if v > best then best = v end
  end
  return full * l.b + best
end

-- Whether a counter's estimate leaves room for this request: its weight's units but the
-- last count as arriving at once, and the last must still find room.
local function room(l, v)
  v = v + (l.w - 1) * l.b
  if l.kind == 'c' then return v < l.a * l.b end
  return v + l.b <= l.a * l.b
end

-- The weight of a fixed clock window's entries that may land in the window starting at s.
local function in_window(l, s)
  local hi = '(' .. num(s + l.b + l.m)
  if not l.weighted then return redis.call('ZCOUNT', l.key, num(s), hi) end
  local total = 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', l.key, num(s), hi)) do
    total = total + wof(m)
  end
  return total
end

-- l's entries scored above `lo`, ascending: their latest arrivals and weights, each
-- arrival first passed through `f` if given (entries then re-sorted).
local function entries(l, lo, f)
  local r = redis.call('ZRANGEBYSCORE', l.key, '(' .. num(lo), '+inf', 'WITHSCORES')
  local es = {}
  for j = 1, #r, 2 do
    local at = tonumber(r[j + 1])
    if f then at = f(at) end
    if at then es[#es + 1] = {at, wof(r[j])} end
  end
  if f then table.sort(es, function(x, y) return x[1] < y[1] end) end
  return es
end

-- The earliest instant at or after t that a sliding window holding `es` (ascending,
-- inside the window of t) has room for l's weight: once enough of the oldest expire.
local function slide(l, t, es)
  local total = l.w
  for _, e in ipairs(es) do total = total + e[2] end
  if total <= l.a then return t end
  for _, e in ipairs(es) do
    total = total - e[2]
    if total <= l.a then return math.max(t, e[1] + l.b) end
  end
  return math.max(t, (es[#es] and es[#es][1] or t) + l.b)
end

-- The earliest instant at or after t that limit l admits one more. With `answered`, as
-- if every reservation whose latest arrival is still ahead had been answered at once
-- (at its instant, or now if that has passed): for sliding windows and GCRAs, the
-- instant a small limit would give once the answers it waits on are in.
local function earliest(l, t, answered)
  if answered and l.kind == 's' then
    return slide(l, t, entries(l, t - l.b, function(v)
      if v > now then v = math.max(now, v - l.m) end
      if v > t - l.b then return v end
      return nil
    end))
  elseif answered and l.kind == 't' then
    local tat = stored(l.key)
    local r = last_of(l)
    if tat and r and r.latest > now then
      tat = math.max(r.before, math.max(now, r.latest - l.m)) + r.w * l.a
    end
    if not tat then return t end
    return math.max(t, tat + (l.w - 1) * l.a - l.b)
  end
  if l.counter then
    local es = entries(l, t - 2 * l.b)
    local scores, ws = {}, {}
    for j, e in ipairs(es) do scores[j], ws[j] = e[1], e[2] end
    if room(l, estimate(l, scores, ws, t)) then return t end
    -- Estimates only fall with time, and are empty two windows after the last entry.
    local lo, hi = t, math.max(t, scores[#scores] or t) + 2 * l.b
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      if room(l, estimate(l, scores, ws, mid)) then hi = mid else lo = mid end
    end
    return hi
  elseif l.kind == 'k' then
    -- A request may land in the window of t or, within its margin, the next one.
    for _ = 1, 64 do
      local s = edge(l, t)
      local s2 = edge(l, t + l.m)
      if in_window(l, s) + l.w > l.a then
        t = s + l.b
      elseif s2 > s and in_window(l, s2) + l.w > l.a then
        t = s2 + l.b
      else
        return t
      end
    end
    return t
  end
  if l.kind == 's' and l.weighted then
    return slide(l, t, entries(l, t - l.b))
  elseif l.kind == 's' then
    local alive = redis.call('ZCOUNT', l.key, '(' .. num(t - l.b), '+inf')
    if alive < l.a then return t end
    -- The entry whose expiry makes room: the (alive - permits + 1)-th to expire.
    local r = redis.call('ZRANGEBYSCORE', l.key, '(' .. num(t - l.b), '+inf', 'WITHSCORES',
                         'LIMIT', alive - l.a, 1)
    return math.max(t, tonumber(r[2]) + l.b)
  elseif l.kind == 'f' then
    local opening = stored(l.aux)
    local hi = lowest(l.key)
    if not opening or not hi or t >= hi + l.b then return t end
    -- The window was opened ahead, by a reservation for later: what came before it is
    -- no longer counted here, so nothing may go before it opens.
    if t < opening then return opening end
    -- Inside the window for sure, while it has room: the arrival ends before the
    -- earliest instant the provider's window may close.
    if weight_from(l, '-inf') + l.w <= l.a and t + l.m < opening + l.b then
      return t
    end
    return hi + l.b
  else
    local tat = stored(l.key)
    if not tat then return t end
    -- The weight's units but the first come on top of the bucket's debt.
    return math.max(t, tat + (l.w - 1) * l.a - l.b)
  end
end

-- The earliest instant every paid limit admits, and whether the rounds found it.
local function admitted(answered)
  local t = now
  for _ = 1, 16 do
    local moved = false
    for k = 1, n do
      if L[k].pays then
        local e = earliest(L[k], t, answered)
        if e > t then t = e; moved = true end
      end
    end
    if not moved then return math.ceil(t), true end
  end
  return math.ceil(t), false
end

local t, settled = admitted(false)
local wait = t - now
if not settled or wait > tonumber(ARGV[7]) then
  return {2, wait, epoch, num(now), ''}
end
local later = wait > tonumber(ARGV[6])

-- Turns. A small limit (a GCRA with a burst of 1, a window of a few permits) whose next
-- instant waits on a reservation not yet answered pays that one's whole margin if
-- reserved now, on every interval. The replica that made it learns the answer first: it
-- asks again once the answer is in, the correction riding on the call, and keeps the
-- limit for the requests it has waiting, up to RUN in a row (the run). Another replica
-- is told when to come back (status 4): when the answer should be in, or the run over.
-- A replica told to come back (4, or 1 beyond the horizon) holds a claim; once the run
-- is over, the one waiting longest that is back by then goes next, for a run of its own.
-- Every reservation is still made at the instant that counts each unanswered one at its
-- latest arrival: turns decide who asks when, never what is admitted.
local RUN = 10
-- Come back this much before the instant: the call's round trip and the timer's grain.
local LEAD = 2000
-- A claim whose replica has not come back this long after it was due is forgotten.
local STALE = 250000
local NOISE = 1000
local flags = ''
-- With status 0, when the replica's next request is to come back (us from now), or 0.
local yield = 0
local step = 0
for k = 1, n do
  local l = L[k]
  if l.pays and l.kind == 's' then step = math.max(step, l.b * l.w / l.a) end
  if l.pays and l.kind == 't' then step = math.max(step, l.a * l.w) end
end
if step == 0 and later then
  return {1, wait, epoch, num(now), ''}
end
if step > 0 then
  local runkey, claimkey = KEYS[2 * n + 2], KEYS[2 * n + 3]
  local me = string.match(ARGV[5], '^(.*):[^:]*$') or ARGV[5]
  local mine = tonumber(ARGV[8]) or 0
  local runner, count, queued = nil, 0, 0
  local run = redis.call('GET', runkey)
  if run then
    runner, count, queued = string.match(run, '^(%S+) (%S+) (%S+)$')
    count, queued = tonumber(count), tonumber(queued)
  end
  -- Claims: replica -> "since due coming": how many of its requests come back then.
  local claims, since = {}, now
  local raw = redis.call('HGETALL', claimkey)
  for j = 1, #raw, 2 do
    local s, d, q = string.match(raw[j + 1], '^(%S+) (%S+) (%S+)$')
    s, d, q = tonumber(s), tonumber(d), tonumber(q)
    if not d or now > d + STALE then
      redis.call('HDEL', claimkey, raw[j])
    elseif raw[j] == me then
      since = s
    else
      claims[#claims + 1] = {since = s, due = d, queued = q}
    end
  end
  -- `coming`: the requests waiting behind this one, and this one unless it is reserved.
  local function claim(due, coming)
    redis.call('HSET', claimkey, me, num(since) .. ' ' .. num(due) .. ' ' .. coming)
    keep(claimkey, due + STALE)
  end
  -- Another replica's run: its next requests go first, up to RUN in a row; then those
  -- waiting longer than this one, a run each (up to their requests waiting).
  local ahead = 0
  if runner and runner ~= me then ahead = math.max(0, math.min(RUN - count, queued)) end
  local function runs(older_than)
    local k = 0
    for _, c in ipairs(claims) do
      if c.since < older_than then k = k + math.min(RUN, c.queued) end
    end
    return k
  end
  if later then
    -- Beyond the horizon: asked again that much before the instant, after the runs.
    local at = t + (ahead + runs(since)) * step
    claim(at - tonumber(ARGV[6]), mine + 1)
    return {1, math.ceil(at - now), epoch, num(now), ''}
  end
  local back = nil
  -- (An instant that is now waits on nothing.)
  local best = t > now + NOISE and admitted(true) or t
  -- Waiting for an answer saves at most t - best; a turn may cost others' runs. An
  -- answer already in may still leave a little (its instant is reported late by up to
  -- the reporting call's round trip): not worth a turn.
  if t > best + math.max(NOISE, step / 8) then
    -- It waits on an answer.
    back = best - LEAD + (ahead + runs(since)) * step
  elseif runner ~= me or count >= RUN then
    -- Free now, and no run of this replica's: one that has waited longer and is back by
    -- now goes first, for as many as it has waiting, up to a run.
    for _, c in ipairs(claims) do
      if c.since < since and c.due <= t + LEAD then back = t + runs(since) * step - LEAD end
    end
  end
  if back and op ~= 'settle' then
    local due = math.max(back, now + 1000)
    claim(due, mine + 1)
    return {4, math.ceil(due - now), epoch, num(now), ''}
  end
  redis.call('HDEL', claimkey, me)
  if runner == me then count = count + 1 else count = 1 end
  put(runkey, me .. ' ' .. count .. ' ' .. mine, t)
  if #claims > 0 then flags = flags .. 'w' end
  if count >= RUN and #claims > 0 and mine > 0 then
    -- The run is over: this replica's next request comes back after the others' runs,
    -- told now rather than on a call of its own.
    since = now
    local back_at = math.ceil(t + (1 + runs(math.huge)) * step - LEAD)
    claim(back_at, mine)
    yield = back_at - now
  end
end

local id = ARGV[5]
local out = {0, wait, epoch, num(now), flags, yield}
for k = 1, n do
  local l = L[k]
  local latest = t + l.m
  out[6 + k] = '0'
  if not l.pays then
    -- only here for its corrections
  elseif l.kind == 's' or l.kind == 'k' or l.counter then
    redis.call('ZADD', l.key, num(latest), named(id, l.w))
    keep(l.key, latest + l.span)
  elseif l.kind == 'f' then
    local hi = lowest(l.key)
    if not hi or t >= hi + l.b then
      redis.call('DEL', l.key)
      redis.call('SET', l.aux, num(t))
    end
    redis.call('ZADD', l.key, num(latest), named(id, l.w))
    keep(l.key, latest + l.b)
    keep(l.aux, latest + l.b)
    out[6 + k] = redis.call('GET', l.aux)
  else
    local before = stored(l.key) or 0
    local tat = math.max(before, latest) + l.w * l.a
    local prev = last_of(l)
    local settled = prev and math.max(prev.settled, prev.latest) or 0
    put(l.key, num(tat), tat)
    set_last(l, {who = named(id, l.w), before = before, latest = latest, w = l.w,
                 settled = settled}, tat)
  end
end
-- Whether the next request would wait on this one's answer.
if step > 0 then
  local next_at = admitted(false)
  if next_at > now + NOISE and next_at > admitted(true) + NOISE then out[5] = flags .. 'c' end
end
return out
