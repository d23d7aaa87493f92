"""What KEDA's ``redis`` trigger runs against its ``listName`` (``NewRedisScaler`` in KEDA's
``pkg/scalers/redis_scaler.go``), written here to the same effect: the key's type, then the
size that type has (a missing key reads as an empty list)."""

from typing import Final

LIST_LENGTH_SCRIPT: Final = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'zset' then return redis.call('ZCARD', KEYS[1]) end
if kind == 'set' then return redis.call('SCARD', KEYS[1]) end
if kind == 'hash' then return redis.call('HLEN', KEYS[1]) end
if kind == 'list' or kind == 'none' then return redis.call('LLEN', KEYS[1]) end
return redis.error_reply('ERR unsupported key type: ' .. kind)
"""
