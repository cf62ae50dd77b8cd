"""The Redis lock store's Lua scripts: each one is one atomic operation, judged by the server's clock.

Every script that needs "now" starts with :data:`mutexcron.backends.redis.LUA_NOW` (the server's
``TIME`` in ms). KEYS are the lock's keys in the store's namespace (one hash slot); the comment
above each script gives its KEYS and ARGV.
"""

from __future__ import annotations

from ..backends.redis import LUA_NOW

__all__ = [
    "ACQUIRE_LUA",
    "CLAIM_MANY_LUA",
    "FORGET_LUA",
    "FORGET_NODE_LUA",
    "HAND_OFF_LUA",
    "HAND_OFF_MANY_LUA",
    "HAND_OVER_LUA",
    "HISTORY_LUA",
    "NODES_LUA",
    "NODES_READ_LUA",
    "READ_LUA",
    "RELEASE_LUA",
    "RENEW_MANY_LUA",
    "RENEW_PRESENCE_LUA",
    "SET_PAUSED_LUA",
]

# acquire_or_renew: take the lock if it is free, released, ours or stale by the *holder's* stored
# ttl (new token on every change of holder), claim a fire time if asked and the lock is not
# paused; return the whole record.
# KEYS: hash, token counter, names set, the namespace's token floor (lock_token_floor).
# ARGV: node_id, ip, ttl_ms, the client's token floor for the name, name[, job, fire_us, nonce].
ACQUIRE_LUA = (
    LUA_NOW
    + """
local h = redis.call('HMGET', KEYS[1], 'holder', 'hb', 'ttl', 'token', 'paused')
local holder, hb, ttl, token = h[1], tonumber(h[2]), tonumber(h[3]), tonumber(h[4]) or 0
local floor = tonumber(ARGV[4]) or 0
local acquired = 0
if holder == ARGV[1] then
  acquired = 1
  redis.call('HSET', KEYS[1], 'hb', string.format('%d', now), 'ttl', ARGV[3], 'active_ip', ARGV[2])
elseif (not holder) or holder == '' or (not hb) or now - hb > (ttl or 0) then
  acquired = 1
  -- Never issue a token at or below one already issued: the counter's, the hash's own, the
  -- client's floor (the highest token that client process saw: it survives a server restart), or
  -- the namespace's floor (every token of a record forget deleted, with its counter).
  local counter = tonumber(redis.call('GET', KEYS[2])) or 0
  local base = math.max(counter, token, floor, tonumber(redis.call('GET', KEYS[4])) or 0)
  if base > counter then redis.call('SET', KEYS[2], string.format('%d', base)) end
  token = redis.call('INCR', KEYS[2])
  redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'active_ip', ARGV[2], 'hb', string.format('%d', now),
             'ttl', ARGV[3], 'token', string.format('%d', token))
  redis.call('SADD', KEYS[3], ARGV[5])
elseif floor > token then
  -- Refused, but this client saw a higher token (the data was lost): lift the counter so the
  -- next holder, whoever it is, still gets a token above it.
  local counter = tonumber(redis.call('GET', KEYS[2])) or 0
  if floor > counter then redis.call('SET', KEYS[2], string.format('%d', floor)) end
end
if acquired == 1 and h[5] ~= '1' then
  if ARGV[6] then
    local raw = redis.call('HGET', KEYS[1], 'fires')
    local ok, fires = pcall(cjson.decode, raw or '{}')
    if not ok or type(fires) ~= 'table' then fires = {} end
    local cur = fires[ARGV[6]]
    local fire_us = tonumber(ARGV[7])
    if type(cur) ~= 'table' or (tonumber(cur[1]) or 0) < fire_us then
      fires[ARGV[6]] = {fire_us, ARGV[8]}
      -- Encoded by hand: cjson prints numbers with 14 digits, epoch microseconds need 16.
      local parts = {}
      for job, v in pairs(fires) do
        if type(v) == 'table' then
          parts[#parts + 1] = cjson.encode(tostring(job)) .. ':[' .. string.format('%d', tonumber(v[1]) or 0)
                              .. ',' .. cjson.encode(tostring(v[2])) .. ']'
        end
      end
      redis.call('HSET', KEYS[1], 'fires', '{' .. table.concat(parts, ',') .. '}')
    end
  end
end
-- One JSON string: the client parses it in C instead of a nested reply field by field.
return cjson.encode({acquired, string.format('%d', now), redis.call('HGETALL', KEYS[1])})
"""
)

# hand_off: refresh the lease if ARGV[1] still holds it with token ARGV[2]; optionally store
# attrs (ARGV[3]=='1', text ARGV[4]) and the last run (ARGV[5]=='1', duration_ms ARGV[6], error ARGV[7..8]),
# appending the run to its job's history: the list KEYS[3] of the runs' history lines
# (mutexcron.locks.record.HISTORY_LINE), oldest first: RPUSH, then LTRIM to the last ARGV[11] (0: no
# history written), whatever the number kept. The field ARGV[9] of the history hash KEYS[2] indexes
# the job (set empty when its list is new); a non-empty field holds runs of the earlier forms
# (lines, or a JSON array of entry texts), moved in front of the list by the job's first run here.
# ARGV[10] is the line after its end time (RunInfo.history_tail); the script writes '[' and the end
# time (ms, server clock) before it.
# KEYS: hash, history hash, the job's runs list. ARGV: node_id, token, has_attrs, attrs, has_run,
# duration_ms, has_error, error, job, line tail, keep. Returns 1 or 0.
HAND_OFF_LUA = (
    LUA_NOW
    + """
local h = redis.call('HMGET', KEYS[1], 'holder', 'token')
if h[1] ~= ARGV[1] or tonumber(h[2]) ~= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'hb', string.format('%d', now))
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'attrs', ARGV[4]) end
if ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'last_run_finished', string.format('%d', now),
             'last_run_started', string.format('%d', now - tonumber(ARGV[6])))
  if ARGV[7] == '1' then redis.call('HSET', KEYS[1], 'last_error', ARGV[8])
  else redis.call('HDEL', KEYS[1], 'last_error') end
  local keep = tonumber(ARGV[11])
  if keep > 0 then
    local entry = '[' .. string.format('%d', now) .. ARGV[10]  -- the history line: its end time, then the run's tail
    local kept = redis.call('RPUSH', KEYS[3], entry)
    if kept == 1 then  -- a new list: index the job, and move in its runs kept in an earlier form
      local old = redis.call('HGET', KEYS[2], ARGV[9])
      if old and old ~= '' then
        local head, lines = string.sub(old, 1, 2), {}
        if head == '["' or head == '[]' or head == '{}' then  -- a JSON array of entry texts
          local ok, runs = pcall(cjson.decode, old)
          if ok and type(runs) == 'table' then lines = runs end
        else
          for line in string.gmatch(old, '[^\\n]+') do lines[#lines + 1] = line end
        end
        for i = #lines, 1, -1 do redis.call('LPUSH', KEYS[3], lines[i]) end
        kept = kept + #lines
      end
      redis.call('HSET', KEYS[2], ARGV[9], '')
    end
    if kept > keep then redis.call('LTRIM', KEYS[3], -keep, -1) end
  end
end
return 1
"""
)

# hand_off_many: HAND_OFF_LUA's body once per item, in order, in one script (one atomic operation):
# item i (from 0) has KEYS[3i+1..3i+3] and ARGV[11i+1..11i+11], as HAND_OFF_LUA's. Returns one 1
# or 0 per item (each item is fenced on its own: a refused one changes nothing).
_HAND_OFF_BODY = HAND_OFF_LUA[len(LUA_NOW) :].replace("KEYS[", "K[").replace("ARGV[", "A[")
HAND_OFF_MANY_LUA = (
    LUA_NOW
    + """
local function hand_off(K, A)
"""
    + _HAND_OFF_BODY
    + """
end
local out = {}
for i = 0, #KEYS / 3 - 1 do
  local A = {}
  for j = 1, 11 do A[j] = ARGV[11 * i + j] end
  out[i + 1] = hand_off({KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]}, A)
end
return out
"""
)

# renew_many: refresh every lease KEYS[i] that ARGV[1] holds with token ARGV[i+1]; return those i.
# KEYS: hash of each lock. ARGV: node_id, then the token of each lock, in KEYS order.
_RENEW_LOOP = """
local stamp = string.format('%d', now)
local out = {}
for i = 1, LOCKS do
  local key = KEYS[i]
  local h = redis.call('HMGET', key, 'holder', 'token')
  if h[1] == ARGV[1] and tonumber(h[2]) == tonumber(ARGV[i + 1]) then
    redis.call('HSET', key, 'hb', stamp)
    out[#out + 1] = i
  end
end
"""
RENEW_MANY_LUA = LUA_NOW + "local LOCKS = #KEYS\n" + _RENEW_LOOP + "return out\n"

# renew_many with a presence: the same renewal of the first #KEYS - 2 keys, then the node's
# presence: field ARGV[1] of the nodes hash (its JSON object ARGV[#KEYS], without ``seen``: the
# script adds it, in ms), its score in the seen zset, both keys expiring ARGV[#KEYS + 1] ms after
# the last presence; members older than that are removed. Returns the renewed i.
# KEYS: hash of each lock, nodes hash, seen zset. ARGV: node_id, each lock's token, presence, ttl_ms.
_PRESENCE = """
local nodes, seen, ttl = KEYS[LOCKS + 1], KEYS[LOCKS + 2], tonumber(ARGV[LOCKS + 3])
redis.call('HSET', nodes, ARGV[1], string.sub(ARGV[LOCKS + 2], 1, -2) .. ',"seen":' .. stamp .. '}')
redis.call('ZADD', seen, now, ARGV[1])
for _, old in ipairs(redis.call('ZRANGEBYSCORE', seen, '-inf', '(' .. string.format('%d', now - ttl))) do
  redis.call('HDEL', nodes, old)
  redis.call('ZREM', seen, old)
end
redis.call('PEXPIRE', nodes, ttl)
redis.call('PEXPIRE', seen, ttl)
"""
RENEW_PRESENCE_LUA = LUA_NOW + "local LOCKS = #KEYS - 2\n" + _RENEW_LOOP + _PRESENCE + "return out\n"

# nodes: the presences younger than ARGV[1] ms (older ones are removed), and the server clock.
# KEYS: nodes hash, seen zset. ARGV: ttl_ms. Returns JSON [now_ms, {node_id: presence JSON, ...} as a flat list].
NODES_LUA = (
    LUA_NOW
    + """
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. string.format('%d', now - tonumber(ARGV[1])))) do
  redis.call('HDEL', KEYS[1], old)
  redis.call('ZREM', KEYS[2], old)
end
return cjson.encode({string.format('%d', now), redis.call('HGETALL', KEYS[1])})
"""
)

# nodes without the prune (a reader that must not write): the fresh presences only.
# KEYS: nodes hash, seen zset. ARGV: ttl_ms. Returns JSON [now_ms, [node_id, presence, ...]].
NODES_READ_LUA = (
    LUA_NOW
    + """
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], string.format('%d', now - tonumber(ARGV[1])), '+inf')) do
  local value = redis.call('HGET', KEYS[1], id)
  if value then
    out[#out + 1] = id
    out[#out + 1] = value
  end
end
return cjson.encode({string.format('%d', now), out})
"""
)

# set_paused: the operator's flag (ARGV[1] '1' or '0'), when (server clock), by whom (ARGV[2]) and
# the resume's catch-up (ARGV[3]); creates the hash if missing (no holder, no token yet) and adds
# the name (ARGV[4]) to the names set. Holder, token and lease are not touched.
# KEYS: hash, names set. Returns JSON [now_ms, fields of the hash].
SET_PAUSED_LUA = (
    LUA_NOW
    + """
redis.call('HSET', KEYS[1], 'paused', ARGV[1], 'paused_at', string.format('%d', now), 'paused_by', ARGV[2],
           'resume_catch_up', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[4])
return cjson.encode({string.format('%d', now), redis.call('HGETALL', KEYS[1])})
"""
)

# forget: unless forced (ARGV[2] '1'), nothing while a holder's lease is live (the acquire's
# staleness rule, reversed); else raise the namespace's token floor to the name's counter and the
# hash's token (so every later holder's token, of this name or any other, is greater: the acquire
# takes the floor into its max), remove the name (ARGV[1]) from the names set and delete the hash,
# the token counter, the history hash and the jobs' runs lists: nothing of the name is left.
# KEYS: hash, token counter, names set, token floor, history hash, runs lists...
# Returns 'deleted', 'held' or 'missing'.
FORGET_LUA = (
    LUA_NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'missing' end
local h = redis.call('HMGET', KEYS[1], 'holder', 'hb', 'ttl', 'token')
local holder, hb, ttl, token = h[1], tonumber(h[2]), tonumber(h[3]), tonumber(h[4]) or 0
if ARGV[2] ~= '1' and holder and holder ~= '' and hb and now - hb <= (ttl or 0) then return 'held' end
local floor = tonumber(redis.call('GET', KEYS[4])) or 0
local spent = math.max(floor, token, tonumber(redis.call('GET', KEYS[2])) or 0)
if spent > floor then redis.call('SET', KEYS[4], string.format('%d', spent)) end
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[1], KEYS[2])
for i = 5, #KEYS do redis.call('DEL', KEYS[i]) end
return 'deleted'
"""
)

# forget_node: the node's presence (ARGV[1]) if last seen at least ARGV[2] ms ago (server clock).
# KEYS: nodes hash, seen zset. Returns 1 if deleted, else 0.
FORGET_NODE_LUA = (
    LUA_NOW
    + """
local seen = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]))
if not seen or now - seen < tonumber(ARGV[2]) then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
)

# history: for each lock, whether its hash exists and its history hash (job -> '' if the job's runs
# are in its list, read next; or its runs in an earlier form: entry texts one per line, or a JSON
# array of them). KEYS: lock hash, history hash, for each lock. Returns JSON [[exists, fields], ...].
HISTORY_LUA = """
local out = {}
for i = 1, #KEYS, 2 do
  out[#out + 1] = {redis.call('EXISTS', KEYS[i]), redis.call('HGETALL', KEYS[i + 1])}
end
return cjson.encode(out)
"""

# claim_many: for every lock KEYS[i] that ARGV[1] holds with its token, refresh the lease and write
# each of its claims whose fire time is newer than the stored one for that job, unless the lock is
# paused; all of a lock's part happens inside this script, so it is atomic with the lease check.
# Returns JSON [[i of each renewed lock], [nonce of each claim the record now holds as ours],
# [i of each renewed lock that is paused], [[nonce, stored nonce] of each claim another one beat]].
# KEYS: hash of each lock. ARGV: node_id, then for each lock in KEYS order: token, number of
# claims n, then n times job, fire_us, nonce.
CLAIM_MANY_LUA = (
    LUA_NOW
    + """
local stamp = string.format('%d', now)
local renewed, won, paused, lost = {}, {}, {}, {}
local a = 2
for i, key in ipairs(KEYS) do
  local token, first = tonumber(ARGV[a]), a + 2
  a = first + 3 * tonumber(ARGV[a + 1])
  local h = redis.call('HMGET', key, 'holder', 'token', 'fires', 'paused')
  if h[1] == ARGV[1] and tonumber(h[2]) == token and h[4] == '1' then
    renewed[#renewed + 1] = i
    paused[#paused + 1] = i
    redis.call('HSET', key, 'hb', stamp)
  elseif h[1] == ARGV[1] and tonumber(h[2]) == token then
    renewed[#renewed + 1] = i
    local ok, fires = pcall(cjson.decode, h[3] or '{}')
    if not ok or type(fires) ~= 'table' then fires = {} end
    local changed = false
    for c = first, a - 1, 3 do
      local job, fire_us, nonce = ARGV[c], tonumber(ARGV[c + 1]), ARGV[c + 2]
      local cur = fires[job]
      if type(cur) ~= 'table' or (tonumber(cur[1]) or 0) < fire_us then
        fires[job] = {fire_us, nonce}
        changed = true
      end
      cur = fires[job]
      if tonumber(cur[1]) == fire_us and cur[2] == nonce then won[#won + 1] = nonce
      else lost[#lost + 1] = {nonce, tostring(cur[2])} end
    end
    if changed then
      -- Encoded by hand, as in ACQUIRE_LUA: cjson prints numbers with 14 digits, epoch microseconds need 16.
      local parts = {}
      for job, v in pairs(fires) do
        if type(v) == 'table' then
          parts[#parts + 1] = cjson.encode(tostring(job)) .. ':[' .. string.format('%d', tonumber(v[1]) or 0)
                              .. ',' .. cjson.encode(tostring(v[2])) .. ']'
        end
      end
      redis.call('HSET', key, 'hb', stamp, 'fires', '{' .. table.concat(parts, ',') .. '}')
    else
      redis.call('HSET', key, 'hb', stamp)
    end
  end
end
return cjson.encode({renewed, won, paused, lost})
"""
)

# release: free the lock if ARGV[1] holds it with token ARGV[2]; keep token, attrs, fires, active_ip.
# KEYS: hash. ARGV: node_id, token. Returns 1 or 0.
RELEASE_LUA = """
local h = redis.call('HMGET', KEYS[1], 'holder', 'token')
if h[1] ~= ARGV[1] or tonumber(h[2]) ~= tonumber(ARGV[2]) then return 0 end
redis.call('HDEL', KEYS[1], 'holder')
return 1
"""

# hand_over: if ARGV[1] holds the lock with token ARGV[2], name ARGV[3] the holder with the next
# token (from the counter and the namespace's floor, as an acquire) and a lease of ARGV[4] ms from
# now, no IP; keep attrs and fires; publish ARGV[3] on channel ARGV[5] (the successor's wake-up).
# Returns 1 or 0.
# KEYS: hash, token counter, token floor. ARGV: node_id, token, successor, within_ms, channel.
HAND_OVER_LUA = (
    LUA_NOW
    + """
local h = redis.call('HMGET', KEYS[1], 'holder', 'token')
if h[1] ~= ARGV[1] or tonumber(h[2]) ~= tonumber(ARGV[2]) then return 0 end
local counter = tonumber(redis.call('GET', KEYS[2])) or 0
local base = math.max(counter, tonumber(h[2]), tonumber(redis.call('GET', KEYS[3])) or 0)
if base > counter then redis.call('SET', KEYS[2], string.format('%d', base)) end
local token = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'holder', ARGV[3], 'hb', string.format('%d', now), 'ttl', ARGV[4],
           'token', string.format('%d', token))
redis.call('HDEL', KEYS[1], 'active_ip')
redis.call('PUBLISH', ARGV[5], ARGV[3])
return 1
"""
)

# set_zone: the holder's time zone (ARGV[3]) and its jobs' triggers (ARGV[4], JSON text), conditional
# on holder and token; an empty value removes the field.
SET_ZONE_LUA = """
local h = redis.call('HMGET', KEYS[1], 'holder', 'token')
if h[1] ~= ARGV[1] or tonumber(h[2]) ~= tonumber(ARGV[2]) then return 0 end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'zone', ARGV[3]) else redis.call('HDEL', KEYS[1], 'zone') end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'triggers', ARGV[4]) else redis.call('HDEL', KEYS[1], 'triggers') end
return 1
"""

# read_many on Redis Cluster: every hash KEYS[i] and the clock of the primary that wrote their
# heartbeats, in one round trip. (A cluster pipeline would ask TIME of another node, and on a hung
# node it re-sends each queued command alone, each waiting out the socket timeout.)
# KEYS: hash of each lock. ARGV: none. Returns JSON [now_ms, [fields of each hash]].
READ_LUA = (
    LUA_NOW
    + """
local rows = {}
for i, key in ipairs(KEYS) do rows[i] = redis.call('HGETALL', key) end
return cjson.encode({string.format('%d', now), rows})
"""
)
