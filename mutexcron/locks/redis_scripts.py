"""The Redis lock store's Lua scripts: each one is one atomic operation, judged by the server's clock.

Every script that needs "now" starts with :data:`mutexcron.backends.redis.LUA_NOW` (the server's
``TIME`` in ms). KEYS are the lock's keys in the store's namespace (one hash slot); the comment
above each script gives its KEYS and ARGV.
"""

from __future__ import annotations

from ..backends.redis import LUA_NOW

__all__ = ["ACQUIRE_LUA", "CLAIM_MANY_LUA", "HAND_OFF_LUA", "READ_LUA", "RELEASE_LUA", "RENEW_MANY_LUA"]

# acquire_or_renew: take the lock if it is free, released, ours or stale by the *holder's* stored
# ttl (new token on every change of holder), claim a fire time if asked; return the whole record.
# KEYS: hash, token counter, names set. ARGV: node_id, ip, ttl_ms, token floor, name[, job, fire_us, nonce].
ACQUIRE_LUA = (
    LUA_NOW
    + """
local h = redis.call('HMGET', KEYS[1], 'holder', 'hb', 'ttl', 'token')
local holder, hb, ttl, token = h[1], tonumber(h[2]), tonumber(h[3]), tonumber(h[4]) or 0
local floor = tonumber(ARGV[4]) or 0
local acquired = 0
if holder == ARGV[1] then
  acquired = 1
  redis.call('HSET', KEYS[1], 'hb', string.format('%d', now), 'ttl', ARGV[3], 'active_ip', ARGV[2])
elseif (not holder) or holder == '' or (not hb) or now - hb > (ttl or 0) then
  acquired = 1
  -- Never issue a token at or below one already issued: the counter's, the hash's own, or the
  -- client's floor (the highest token that client process saw: it survives a server restart).
  local counter = tonumber(redis.call('GET', KEYS[2])) or 0
  local base = math.max(counter, token, floor)
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
if acquired == 1 then
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
# attrs (ARGV[3]=='1', text ARGV[4]) and the last run (ARGV[5]=='1', duration_ms ARGV[6], error ARGV[7..8]).
# KEYS: hash. ARGV: node_id, token, has_attrs, attrs, has_run, duration_ms, has_error, error. Returns 1 or 0.
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
end
return 1
"""
)

# renew_many: refresh every lease KEYS[i] that ARGV[1] holds with token ARGV[i+1]; return those i.
# KEYS: hash of each lock. ARGV: node_id, then the token of each lock, in KEYS order.
RENEW_MANY_LUA = (
    LUA_NOW
    + """
local stamp = string.format('%d', now)
local out = {}
for i, key in ipairs(KEYS) do
  local h = redis.call('HMGET', key, 'holder', 'token')
  if h[1] == ARGV[1] and tonumber(h[2]) == tonumber(ARGV[i + 1]) then
    redis.call('HSET', key, 'hb', stamp)
    out[#out + 1] = i
  end
end
return out
"""
)

# claim_many: for every lock KEYS[i] that ARGV[1] holds with its token, refresh the lease and write
# each of its claims whose fire time is newer than the stored one for that job; all of a lock's
# part happens inside this script, so it is atomic with the lease check. Returns JSON
# [[i of each renewed lock], [nonce of each claim the record now holds as ours]].
# KEYS: hash of each lock. ARGV: node_id, then for each lock in KEYS order: token, number of
# claims n, then n times job, fire_us, nonce.
CLAIM_MANY_LUA = (
    LUA_NOW
    + """
local stamp = string.format('%d', now)
local renewed, won = {}, {}
local a = 2
for i, key in ipairs(KEYS) do
  local token, first = tonumber(ARGV[a]), a + 2
  a = first + 3 * tonumber(ARGV[a + 1])
  local h = redis.call('HMGET', key, 'holder', 'token', 'fires')
  if h[1] == ARGV[1] and tonumber(h[2]) == token then
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
      if tonumber(cur[1]) == fire_us and cur[2] == nonce then won[#won + 1] = nonce end
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
return cjson.encode({renewed, won})
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
