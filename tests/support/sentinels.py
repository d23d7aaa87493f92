"""A replicated Redis behind three Sentinels, for the tests of a failover."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from devkit.redis_server import RedisServer, SentinelServer

MASTER = "streamq-master"
"""The name the Sentinels know the master by."""


@contextlib.contextmanager
def replicated_redis_with_sentinels() -> Iterator[tuple[str, RedisServer, RedisServer, list[SentinelServer]]]:
    """A password-protected master, one replica and three Sentinels (quorum 2) that fail
    over one second after the master stops answering; the ``redis+sentinel://`` URL."""
    password = uuid.uuid4().hex
    with (
        RedisServer(user="streamq", password=password) as master,
        RedisServer(user="streamq", password=password, replica_of=master) as replica,
    ):
        sentinels = [SentinelServer(master, MASTER, quorum=2, down_after_ms=1000) for _ in range(3)]
        try:
            for sentinel in sentinels:
                sentinel.start()
            for sentinel in sentinels:  # each knows the replica and the other two: a failover can happen
                sentinel.wait_until(lambda s: int(s["num-slaves"]) == 1 and int(s["num-other-sentinels"]) == 2)
            hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinels)
            yield f"redis+sentinel://streamq:{password}@{hosts}/{MASTER}", master, replica, sentinels
        finally:
            for sentinel in sentinels:
                sentinel.stop()
