"""A connection to the master that Sentinel names asks the Sentinels again before every
attempt (``streamq.broker.connection.SentinelFollowingConnection``): redis-py's own retries
the address it was handed for the whole retry budget, so a command sent as the master died
kept trying the dead one while a replica had been promoted (20 s against about 2)."""

from __future__ import annotations

from typing import Any

from devkit.redis_server import RedisServer, free_port
from streamq.broker.connection import RetryFor, SentinelFollowingPool, connection_options, redis_settings_for


class MovingSentinels:
    """Sentinels as the pool asks them (``discover_master``): the dead master first, then
    the promoted one."""

    def __init__(self, *addresses: tuple[str, int]) -> None:
        self.addresses = list(addresses)
        self.asked = 0

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        self.asked += 1
        return self.addresses[min(self.asked, len(self.addresses)) - 1]


async def test_a_connection_refused_by_the_old_master_asks_the_sentinels_again_and_reaches_the_new_one() -> None:
    with RedisServer() as promoted:
        sentinels = MovingSentinels(("127.0.0.1", free_port()), ("127.0.0.1", promoted.port))
        options: dict[str, Any] = connection_options(redis_settings_for(promoted.url))  # as the worker's
        options["retry"] = RetryFor(budget_s=5.0)  # the dead master alone, retried, would use it up
        pool = SentinelFollowingPool("master", sentinels, **options)  # type: ignore[arg-type]
        connection = await pool.get_connection()
        try:
            await connection.send_command("PING")
            assert await connection.read_response() == b"PONG"
            assert (connection.host, connection.port) == ("127.0.0.1", promoted.port)
            assert sentinels.asked == 2, "the dead master was tried once, then the Sentinels asked again"
        finally:
            await pool.release(connection)
            await pool.disconnect()
