"""The Redis task store's Lua scripts: each one is one atomic operation, judged by the server's clock.

Times are epoch microseconds (exact in a Lua double), read from the server's ``TIME`` by
:data:`LUA_NOW_US` at the top of each script. Every key is in the store's namespace, so it shares
the ``{<namespace>}`` hash tag (one slot: Redis Cluster safe). ``KEYS[1]`` is the namespace's codes
set (it routes the call to the slot's primary); the task hashes and due ZSETs are named from
``ARGV[1]``, the namespace's key prefix: ``<prefix>task:<code>:<key>`` (in the code, ``%`` and ``:``
are escaped as ``%25`` and ``%3A``: ``("a:b", "c")`` and ``("a", "b:c")`` stay two tasks) and
``<prefix>due:<code>``.

A due ZSET per code holds every task of the code, scored by when a claim may take it (the hash's
``run_at``): its due or a retry's time (queued: a retry keeps the hash's ``due``, which names the
occurrence), its lease's end (running: a dead worker's task is claimable again from the same
ZSET), ``+inf`` (failed: never claimed). The comment above each script gives its KEYS and ARGV.

Every script that queues a task (``add``, ``retry``, ``release``, and ``complete`` when it queues
it again) publishes the code on ``<prefix>task_wake`` when the task comes before the head of its
due ZSET (see ``wake``), at most once per code and call: the sleeping workers' notice
(:mod:`mutexcron.tasks.wakeups.redis`).
"""

from __future__ import annotations

from . import FINISHED_TTL

__all__ = [
    "ADD_LUA",
    "ADD_MANY_LUA",
    "CANCEL_LUA",
    "CLAIM_LUA",
    "COMPLETE_LUA",
    "FINISHED_LUA",
    "INDEX_DUES_LUA",
    "LIST_LUA",
    "NEXT_DUE_LUA",
    "NOW_LUA",
    "RELEASE_LUA",
    "RENEW_LUA",
    "RETRY_LUA",
    "SUMMARY_LUA",
]

#: The server's ``TIME`` in microseconds as ``now``, and helpers every script shares.
LUA_NOW_US = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local P = ARGV[1]
local function us(x) return string.format('%d', x) end
-- The code is escaped (% and : as %25 and %3A) so that the first ':' after it ends it.
local function hkey(code, key) return P .. 'task:' .. code:gsub('%%', '%%25'):gsub(':', '%%3A') .. ':' .. key end
local function zkey(code) return P .. 'due:' .. code end
-- The code's tasks by due (list pages through it in due order).
local function dkey(code) return P .. 'dues:' .. code end
-- The highest token of a deleted task: a task added again starts from it (tokens only go up).
local FLOOR = P .. 'task_token_floor'
local function floor() return tonumber(redis.call('GET', FLOOR)) or 0 end
-- Fenced: running, owned by node, with token.
local function fenced(h, node, token)
  local f = redis.call('HMGET', h, 'state', 'owner', 'token')
  return f[1] == 'running' and f[2] == node and tonumber(f[3]) == tonumber(token)
end
-- Queued, claimable from run_at: the same occurrence (its due is kept).
local function wait_at(h, code, key, run_at)
  redis.call('HSET', h, 'state', 'queued', 'run_at', us(run_at), 'lease_until', '', 'updated', us(now))
  redis.call('ZADD', zkey(code), run_at, key)
end
-- Queued as a new occurrence, due at `due`, named by the token it begins at.
local function queue(h, code, key, due)
  redis.call('HSET', h, 'due', us(due), 'occurrence', redis.call('HGET', h, 'token'))
  redis.call('ZADD', dkey(code), due, key)
  wait_at(h, code, key, due)
end
-- Occurrences ended per minute of the server's clock (the dashboard's throughput): one hash per
-- minute, <prefix>finished:<minute since the epoch>, field '<ended>:<code>' (ended: done or
-- cancelled), expiring FINISHED_TTL seconds after its first count. A script counts its ends in
-- `ends` and writes them once, at its end (save_ends): one HINCRBY per code and way, not per task.
-- pcall: a count that cannot be written (a foreign value at the key) never fails the script's
-- writes before it (a script is not rolled back).
local ends = {}
local function count_end(code, ended)
  local field = ended .. ':' .. code
  ends[field] = (ends[field] or 0) + 1
end
local function save_ends()
  local k = P .. 'finished:' .. string.format('%d', math.floor(now / 60000000))
  for field, n in pairs(ends) do
    if redis.pcall('HINCRBY', k, field, n) == n then redis.pcall('EXPIRE', k, {finished_ttl}) end
  end
end
-- Delete a task whose occurrence ended (ended: done or cancelled), raising the token floor to its token.
local function drop(h, code, key, ended)
  local token = tonumber(redis.call('HGET', h, 'token')) or 0
  if token > floor() then redis.call('SET', FLOOR, us(token)) end
  redis.call('DEL', h)
  redis.call('ZREM', zkey(code), key)
  redis.call('ZREM', dkey(code), key)
  count_end(code, ended)
end
-- A task queued at `due` wakes the sleeping workers of its code (tasks.wakeup_redis) only if it
-- is due before the head of the code's due ZSET was claimable (`before`: read before the write;
-- nil for an empty ZSET; inf for failed tasks only): a worker already sleeps until the head's time.
local function head(code)
  return tonumber(redis.call('ZRANGE', zkey(code), 0, 0, 'WITHSCORES')[2])
end
local published = {}
local function wake(code, due, before)
  if (before == nil or due < before) and not published[code] then
    published[code] = true  -- once per code and call
    redis.call('PUBLISH', P .. 'task_wake', code)
  end
end
-- The re-add made while the attempt ran becomes the task: a new definition, attempts reset.
-- Returns its due.
local function apply_pending(h, code, key)
  local p = redis.call('HMGET', h, 'pending_due', 'pending_payload')
  local due = tonumber(p[1])
  queue(h, code, key, due)
  redis.call('HSET', h, 'payload', p[2], 'attempt', '0', 'last_error', '', 'pending_due', '', 'pending_payload', '')
  return due
end
""".replace("{finished_ttl}", str(FINISHED_TTL))

#: One task's add, as a Lua function of ``a = {code, key, due_us or '', delay_us or '', payload, mode}``
#: (ADD_LUA runs it once, ADD_MANY_LUA once per task). Needs LUA_NOW_US's helpers.
_ADD_FUNCTION = """
local function add(a)
  local code, key, mode = a[1], a[2], a[6]
  local due
  if a[3] ~= '' then due = tonumber(a[3]) else due = now + tonumber(a[4]) end
  local h = hkey(code, key)
  local f = redis.call('HMGET', h, 'state', 'due', 'pending_due')
  local state, old, pending = f[1], tonumber(f[2]), tonumber(f[3])
  local function wins(old_due)
    if mode == 'earliest' then return due < old_due end
    return mode == 'latest' and due > old_due
  end
  local before = head(code)
  if not state then
    local token = us(floor())
    redis.call('HSET', h, 'code', code, 'key', key, 'state', 'queued', 'due', us(due), 'run_at', us(due), 'payload', a[5],
               'attempt', '0', 'token', token, 'occurrence', token, 'owner', '', 'lease_until', '', 'last_error', '',
               'pending_due', '', 'pending_payload', '', 'cancel_requested', '0', 'created', us(now), 'updated', us(now))
    redis.call('ZADD', zkey(code), due, key)
    redis.call('ZADD', dkey(code), due, key)
    redis.call('SADD', KEYS[1], code)
    wake(code, due, before)
    return 'inserted'
  end
  if mode == 'keep' then return 'kept' end
  if state == 'running' then
    if (not pending) or mode == 'replace' or wins(pending) then
      redis.call('HSET', h, 'pending_due', us(due), 'pending_payload', a[5], 'cancel_requested', '0',
                 'updated', us(now))
      return 'pending'
    end
    return 'kept'
  end
  if state == 'failed' or mode == 'replace' or wins(old) then
    queue(h, code, key, due)
    redis.call('HSET', h, 'payload', a[5], 'attempt', '0', 'last_error', '')
    wake(code, due, before)
    return 'replaced'
  end
  return 'kept'
end
"""

# add: upsert (code, key) by on_conflict (tasks.checks.decide_add, the same rule).
# KEYS: codes set. ARGV: prefix, code, key, due_us or '', delay_us or '', payload, mode.
# Returns 'inserted', 'replaced', 'kept' or 'pending'. An insert or a replace publishes the code
# (see wake) if the task is now the first of its code to become claimable.
ADD_LUA = LUA_NOW_US + _ADD_FUNCTION + "return add({ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]})\n"

# add_many: ADD_LUA for many tasks in one call, in order, one clock reading.
# KEYS: codes set. ARGV: prefix, mode, then per task: code, key, due_us or '', delay_us or '', payload.
# Returns each task's result, in order.
ADD_MANY_LUA = (
    LUA_NOW_US
    + _ADD_FUNCTION
    + """
local out = {}
for i = 3, #ARGV, 5 do
  out[#out + 1] = add({ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[2]})
end
return out
"""
)

# cancel: drop the task; a running one is marked and dropped when its attempt ends.
# KEYS: codes set. ARGV: prefix, code, key. Returns 1, or 0 if there is no such task.
CANCEL_LUA = (
    LUA_NOW_US
    + """
local h = hkey(ARGV[2], ARGV[3])
local state = redis.call('HGET', h, 'state')
if not state then return 0 end
if state ~= 'running' then
  drop(h, ARGV[2], ARGV[3], 'cancelled')
else
  redis.call('HSET', h, 'cancel_requested', '1', 'pending_due', '', 'pending_payload', '', 'updated', us(now))
end
save_ends()
return 1
"""
)

# retry: queue a failed task again, claimable now (the same occurrence: due kept), attempts reset.
# KEYS: codes set. ARGV: prefix, code, key. Returns 1, or 0 if it is not failed. Publishes as add does.
RETRY_LUA = (
    LUA_NOW_US
    + """
local h = hkey(ARGV[2], ARGV[3])
if redis.call('HGET', h, 'state') ~= 'failed' then return 0 end
local before = head(ARGV[2])
wait_at(h, ARGV[2], ARGV[3], now)
wake(ARGV[2], now, before)
redis.call('HSET', h, 'attempt', '0')
return 1
"""
)

# list: one page of one code's tasks in due order (the code's dues ZSET), filtered, from a cursor:
# it stops after `limit` matches or `budget` members read, so no call blocks the server long.
# KEYS: codes set. ARGV: prefix, code, key_contains or '', due_before_us or '', state or '', limit,
# budget, cursor score or '' (from the start), members of that score already read.
# Returns JSON: [[hgetall, ...], next cursor score or '' (no more), members of it read].
LIST_LUA = (
    LUA_NOW_US
    + """
local code, contains, before, state = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local limit, budget = tonumber(ARGV[6]), tonumber(ARGV[7])
local from, skip = '-inf', 0
if ARGV[8] ~= '' then from, skip = ARGV[8], tonumber(ARGV[9]) end
local upto = '+inf'
if before then upto = '(' .. us(before) end
local got = redis.call('ZRANGEBYSCORE', dkey(code), from, upto, 'WITHSCORES', 'LIMIT', skip, budget)
local out, cursor, seen = {}, ARGV[8], skip
for j = 1, #got, 2 do
  local key, score = got[j], got[j + 1]
  if score == cursor then seen = seen + 1 else cursor, seen = score, 1 end
  if contains == '' or string.find(key, contains, 1, true) then
    local h = hkey(code, key)
    local f = redis.call('HMGET', h, 'due', 'state')
    if f[1] and (state == '' or f[2] == state) then
      out[#out + 1] = redis.call('HGETALL', h)
      if #out >= limit then return cjson.encode({out, cursor, seen}) end
    end
  end
end
if #got < 2 * budget then cursor = '' end
return cjson.encode({out, cursor, seen})
"""
)

# index_dues: fill the code's dues ZSET from its due ZSET and hashes (tasks written by an earlier
# mutexcron have no entry), one bounded page at a time. KEYS: codes set. ARGV: prefix, code,
# offset, count. Returns the number of members read (fewer than count: the end).
INDEX_DUES_LUA = (
    LUA_NOW_US
    + """
local code, offset, count = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local keys = redis.call('ZRANGE', zkey(code), offset, offset + count - 1)
for _, key in ipairs(keys) do
  local due = redis.call('HGET', hkey(code, key), 'due')
  if due then redis.call('ZADD', dkey(code), due, key) end
end
return #keys
"""
)

# claim: up to limit claimable tasks of the codes, earliest first (queued and due, or running with
# an expired lease); a rescued task cancelled meanwhile is dropped, not returned.
# KEYS: codes set. ARGV: prefix, node, limit, lease_us, code...  Returns JSON: [now, [hgetall, ...]].
CLAIM_LUA = (
    LUA_NOW_US
    + """
local node, limit, lease = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local found = {}
for i = 5, #ARGV do
  local code = ARGV[i]
  local got = redis.call('ZRANGEBYSCORE', zkey(code), '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
  for j = 1, #got, 2 do found[#found + 1] = {tonumber(got[j + 1]), code, got[j]} end
end
table.sort(found, function(a, b)
  if a[1] ~= b[1] then return a[1] < b[1] end
  if a[2] ~= b[2] then return a[2] < b[2] end
  return a[3] < b[3]
end)
local out = {}
for i = 1, math.min(limit, #found) do
  local code, key = found[i][2], found[i][3]
  local h = hkey(code, key)
  local f = redis.call('HMGET', h, 'state', 'cancel_requested', 'started')
  if f[1] == 'running' and f[2] == '1' then
    drop(h, code, key, 'cancelled')  -- its worker died after a cancel: nothing is left to finish
  elseif f[1] then
    redis.call('HINCRBY', h, 'token', 1)
    if f[1] ~= 'running' or f[3] == '1' then  -- a rescued claim that never started is not counted twice
      redis.call('HINCRBY', h, 'attempt', 1)
    end
    redis.call('HSET', h, 'started', '0', 'state', 'running', 'owner', node, 'lease_until', us(now + lease),
               'run_at', us(now + lease), 'updated', us(now))
    redis.call('ZADD', zkey(code), now + lease, key)
    out[#out + 1] = redis.call('HGETALL', h)
  else
    redis.call('ZREM', zkey(code), key)  -- a member without its hash (never written so): drop it
  end
end
save_ends()
return cjson.encode({us(now), out})
"""
)

# renew: extend the leases node holds. KEYS: codes set. ARGV: prefix, node, lease_us, then
# code, key, token per task. Returns the 1-based indexes (of the triples) renewed.
RENEW_LUA = (
    LUA_NOW_US
    + """
local node, lease = ARGV[2], tonumber(ARGV[3])
local out = {}
for i = 4, #ARGV, 3 do
  local code, key = ARGV[i], ARGV[i + 1]
  local h = hkey(code, key)
  if fenced(h, node, ARGV[i + 2]) then
    redis.call('HSET', h, 'lease_until', us(now + lease), 'run_at', us(now + lease))
    redis.call('ZADD', zkey(code), now + lease, key)
    out[#out + 1] = (i - 1) / 3
  end
end
return out
"""
)

# complete: record the outcome of each attempt node still runs with its token (each fenced on its own,
# in order). KEYS: codes set. ARGV: prefix, node, then per completion: code, key, token, kind
# (done|reschedule|retry|fail), due_us or '', delay_us or '', error, a reschedule's new payload or ''
# (keep it). Returns 1 or 0 (fenced out:
# nothing changed) per completion. A task queued again publishes its code as add does (see wake).
COMPLETE_LUA = (
    LUA_NOW_US
    + """
local node = ARGV[2]
local out = {}
for i = 3, #ARGV, 8 do
  local code, key, kind = ARGV[i], ARGV[i + 1], ARGV[i + 3]
  local h = hkey(code, key)
  local ok = 0
  if fenced(h, node, ARGV[i + 2]) then
    ok = 1
    local before = head(code)
    local f = redis.call('HMGET', h, 'cancel_requested', 'pending_due')
    local pending = f[2] and f[2] ~= ''
    if f[1] == '1' then
      drop(h, code, key, 'cancelled')  -- a cancel asked during the attempt ends the occurrence
    elseif kind == 'done' and not pending then
      drop(h, code, key, 'done')
    elseif pending then
      wake(code, apply_pending(h, code, key), before)
    elseif kind == 'fail' then
      redis.call('HSET', h, 'state', 'failed', 'run_at', '', 'lease_until', '', 'last_error', ARGV[i + 6], 'updated', us(now))
      redis.call('ZADD', zkey(code), 'inf', key)
    else
      local at
      if ARGV[i + 4] ~= '' then at = tonumber(ARGV[i + 4]) else at = now + tonumber(ARGV[i + 5]) end
      if kind == 'reschedule' then
        queue(h, code, key, at)  -- a new occurrence
        redis.call('HSET', h, 'attempt', '0', 'last_error', '')
        if ARGV[i + 7] ~= '' then redis.call('HSET', h, 'payload', ARGV[i + 7]) end
      else
        wait_at(h, code, key, at)  -- the same occurrence: its due is kept
        redis.call('HSET', h, 'last_error', ARGV[i + 6])
      end
      wake(code, at, before)
    end
  end
  out[#out + 1] = ok
end
save_ends()
return out
"""
)

# start: mark the claims whose handler started (a rescue counts them). KEYS: codes set. ARGV:
# prefix, node, then code, key, token per task. Returns how many were marked.
START_LUA = (
    LUA_NOW_US
    + """
local node, marked = ARGV[2], 0
for i = 3, #ARGV, 3 do
  local h = hkey(ARGV[i], ARGV[i + 1])
  if fenced(h, node, ARGV[i + 2]) then
    redis.call('HSET', h, 'started', '1')
    marked = marked + 1
  end
end
return marked
"""
)

# release: hand back claimed, unstarted tasks: claimable at once (due kept), token + 1, the claim not
# counted. KEYS: codes set. ARGV: prefix, node, then code, key, token per task. Returns how many.
# A task queued again publishes its code as add does (see wake).
RELEASE_LUA = (
    LUA_NOW_US
    + """
local node = ARGV[2]
local count = 0
for i = 3, #ARGV, 3 do
  local code, key = ARGV[i], ARGV[i + 1]
  local h = hkey(code, key)
  if fenced(h, node, ARGV[i + 2]) then
    count = count + 1
    local f = redis.call('HMGET', h, 'cancel_requested', 'pending_due')
    if f[1] == '1' then
      drop(h, code, key, 'cancelled')
    else
      local before = head(code)
      redis.call('HINCRBY', h, 'token', 1)  -- a claim made with the old token can no longer write
      if f[2] and f[2] ~= '' then
        wake(code, apply_pending(h, code, key), before)
      else
        redis.call('HINCRBY', h, 'attempt', -1)  -- never started: the claim does not count
        wait_at(h, code, key, now)
        wake(code, now, before)
      end
    end
  end
end
save_ends()
return count
"""
)

# next_due: the earliest claimable time of the codes. KEYS: codes set. ARGV: prefix, code...
# Returns JSON: [now, earliest or '' (none)].
NEXT_DUE_LUA = (
    LUA_NOW_US
    + """
local best = nil
for i = 2, #ARGV do
  local head = redis.call('ZRANGE', zkey(ARGV[i]), 0, 0, 'WITHSCORES')
  local score = tonumber(head[2])
  if score and head[2] ~= 'inf' and score ~= math.huge and (best == nil or score < best) then best = score end
end
if best == nil then return cjson.encode({us(now), ''}) end  -- none: a due before 1970 is a negative score
return cjson.encode({us(now), us(best)})
"""
)

# summary: counts per code. KEYS: codes set. ARGV: prefix, code... (none: every code of the codes
# set that has a task). Returns JSON: [now, [[code, queued, due_now, running, failed, oldest due
# or ''], ...]] (times as strings: cjson would round 16-digit microseconds).
# The failed count and the due-now count are ZCOUNTs on the due ZSET's scores (O(log N)). Telling
# queued from running needs each task's state, which only its hash holds (a running task's score is
# its lease's end, a queued one's its due: both finite): one HMGET per task that is not failed, so
# the script is O(tasks of the codes) and blocks the server that long (about 1 ms per thousand
# tasks). For `status` and metrics, not for a hot path.
SUMMARY_LUA = (
    LUA_NOW_US
    + """
local codes = {}
for i = 2, #ARGV do codes[#codes + 1] = ARGV[i] end
local every = #codes == 0
if every then codes = redis.call('SMEMBERS', KEYS[1]) end
local out = {}
for _, code in ipairs(codes) do
  local z = zkey(code)
  local total = redis.call('ZCARD', z)
  if total > 0 or not every then
    local failed = redis.call('ZCOUNT', z, '+inf', '+inf')
    local due_now = redis.call('ZCOUNT', z, '-inf', now)
    local queued, running, oldest = 0, 0, nil
    local members = redis.call('ZRANGEBYSCORE', z, '-inf', '(+inf', 'WITHSCORES')
    for j = 1, #members, 2 do
      local f = redis.call('HMGET', hkey(code, members[j]), 'state', 'due')
      if f[1] == 'queued' then queued = queued + 1 elseif f[1] == 'running' then running = running + 1 end
      if tonumber(members[j + 1]) <= now and f[2] then
        local due = tonumber(f[2])
        if (not oldest) or due < oldest then oldest = due end
      end
    end
    local oldest_text = ''
    if oldest then oldest_text = us(oldest) end
    out[#out + 1] = {code, queued, due_now, running, failed, oldest_text}
  end
end
return cjson.encode({us(now), out})
"""
)

# finished: the counts of ended occurrences (see count_end) of the minutes from since_minute (no earlier
# than FINISHED_TTL ago) to the current one, a read. KEYS: codes set. ARGV: prefix, since_minute
# (minutes since the epoch). Returns JSON: [[minute, '<ended>:<code>', count], ...].
FINISHED_LUA = (
    LUA_NOW_US
    + """
local last = math.floor(now / 60000000)
local first = math.max(tonumber(ARGV[2]), last - math.floor({finished_ttl} / 60))
local out = {}
for minute = first, last do
  local flat = redis.call('HGETALL', P .. 'finished:' .. string.format('%d', minute))
  for j = 1, #flat, 2 do out[#out + 1] = {minute, flat[j], tonumber(flat[j + 1])} end
end
if #out == 0 then return '[]' end  -- cjson encodes an empty table as {}
return cjson.encode(out)
""".replace("{finished_ttl}", str(FINISHED_TTL))
)

# now: the server's clock (on a cluster: the clock of the primary that owns the namespace).
# KEYS: codes set. ARGV: prefix. Returns the time in epoch microseconds, as a string.
NOW_LUA = LUA_NOW_US + "return us(now)\n"
