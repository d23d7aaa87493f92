"""The producer's pub/sub reader: every published event reaches each follower of its
channel once and in order, however many arrive in one read; the handle's watchdog
wakes it only after a silence. Real Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from devkit.redis_server import RedisServer
from producer.subscriber import RESYNC, EventSubscriber, Inbox
from streamq.broker.connection import close_pool, create_pool, redis_settings_for
from streamq.broker.pubsub import _buffered_replies, live_messages
from streamq.protocol import events_channel


@pytest.fixture
async def subscriber(raw_redis: aioredis.Redis) -> AsyncIterator[EventSubscriber]:
    subscriber = EventSubscriber(raw_redis)
    yield subscriber
    await subscriber.close()


def drain(inbox: Inbox) -> list[object]:
    items: list[object] = []
    while not inbox.empty():
        items.append(inbox.get_nowait())
    return items


async def test_a_burst_reaches_each_follower_of_its_channel_once_and_in_order(
    subscriber: EventSubscriber, raw_redis: aioredis.Redis
) -> None:
    first, second = events_channel(f"a-{uuid.uuid4().hex}"), events_channel(f"b-{uuid.uuid4().hex}")
    followers = [await subscriber.subscribe(first), await subscriber.subscribe(first)]
    other = await subscriber.subscribe(second)
    count = 3000  # far more than one socket read holds
    async with raw_redis.pipeline(transaction=False) as pipe:
        for i in range(count):
            pipe.publish(first if i % 3 else second, b"%d" % i)
        await pipe.execute()
    await raw_redis.publish(second, b"end")
    received: list[object] = []
    while received[-1:] != [b"end"]:
        received.append(await asyncio.wait_for(other.get(), timeout=10))
    expected_first = [b"%d" % i for i in range(count) if i % 3]
    assert received == [b"%d" % i for i in range(count) if not i % 3] + [b"end"]
    for inbox in followers:
        assert drain(inbox) == expected_first


async def test_a_channel_followed_mid_burst_is_confirmed_and_gets_what_follows(
    subscriber: EventSubscriber, raw_redis: aioredis.Redis
) -> None:
    """Subscription confirmations arrive between published messages in one read."""
    busy = events_channel(f"busy-{uuid.uuid4().hex}")
    busy_inbox = await subscriber.subscribe(busy)

    async def publish_burst() -> None:
        async with raw_redis.pipeline(transaction=False) as pipe:
            for i in range(2000):
                pipe.publish(busy, b"%d" % i)
            await pipe.execute()

    burst = asyncio.ensure_future(publish_burst())
    late = events_channel(f"late-{uuid.uuid4().hex}")
    late_inbox = await asyncio.wait_for(subscriber.subscribe(late), timeout=10)
    await burst
    await raw_redis.publish(late, b"after")
    assert await asyncio.wait_for(late_inbox.get(), timeout=10) == b"after"
    await raw_redis.publish(busy, b"end")
    received: list[object] = []
    while received[-1:] != [b"end"]:
        received.append(await asyncio.wait_for(busy_inbox.get(), timeout=10))
    assert received == [b"%d" % i for i in range(2000)] + [b"end"]


async def test_an_inbox_wakes_its_reader_after_a_silence_and_not_while_deliveries_flow() -> None:
    inbox = Inbox()
    stop = asyncio.Event()

    async def deliver() -> None:
        i = 0
        while not stop.is_set():
            inbox.put_nowait(b"%d" % i)
            i += 1
            await asyncio.sleep(0.01)

    delivering = asyncio.ensure_future(deliver())
    got: list[object] = []
    try:
        while len(got) < 50:
            got.append(await inbox.get(silence_s=2.0))
    finally:
        stop.set()
        await delivering
    assert got == [b"%d" % i for i in range(50)]  # no None: never silent for 2 s
    drain(inbox)
    assert await asyncio.wait_for(inbox.get(silence_s=0.2), timeout=5) is None
    inbox.put_nowait(b"late")
    assert await inbox.get(silence_s=0.2) == b"late"
    inbox.close()


async def test_live_messages_yields_each_message_of_a_burst_as_a_dict(raw_redis: aioredis.Redis) -> None:
    """The form the workers' wake-up and cancel listeners read."""
    channel = f"streamq:test:{uuid.uuid4().hex}"
    pubsub = raw_redis.pubsub()
    await pubsub.subscribe(channel)
    async with raw_redis.pipeline(transaction=False) as pipe:
        for i in range(500):
            pipe.publish(channel, b"%d" % i)
        await pipe.execute()
    messages = []
    try:
        async with asyncio.timeout(10):
            async for message in live_messages(pubsub):
                messages.append(message)
                if message["data"] == b"499":
                    break
    finally:
        await pubsub.aclose()
    assert messages[0]["type"] == "subscribe"
    assert [(m["type"], m["channel"], m["data"]) for m in messages[1:]] == [
        ("message", channel.encode(), b"%d" % i) for i in range(500)
    ]


class HeldSubscriptions:
    """Stands in for the subscriber's writes of SUBSCRIBE: tells when one is asked for,
    and writes it only if ``send`` is set, once ``gate`` is open. Other commands pass."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, send: bool) -> None:
        self.asked, self.gate, self.send = asyncio.Event(), asyncio.Event(), send
        self._pending: set[asyncio.Task[None]] = set()
        original = EventSubscriber._send

        def send_command(subscriber: EventSubscriber, pubsub: PubSub, *command: str) -> bool:
            if command[0] != "SUBSCRIBE":
                return original(subscriber, pubsub, *command)
            self.asked.set()
            if self.send:
                task = asyncio.ensure_future(self._write_once_open(original, subscriber, pubsub, command))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
            return True

        monkeypatch.setattr(EventSubscriber, "_send", send_command)

    async def _write_once_open(
        self, original: Any, subscriber: EventSubscriber, pubsub: PubSub, command: tuple[str, ...]
    ) -> None:
        await self.gate.wait()
        original(subscriber, pubsub, *command)


async def numsub(redis: aioredis.Redis, channel: str) -> int:
    [(_, count)] = await redis.pubsub_numsub(channel)
    return int(count)


async def test_a_follower_cancelled_as_its_subscription_is_confirmed_stops(
    subscriber: EventSubscriber, monkeypatch: pytest.MonkeyPatch
) -> None:
    await subscriber.subscribe(events_channel(f"warm-{uuid.uuid4().hex}"))  # the reader runs
    held = HeldSubscriptions(monkeypatch, send=False)
    held.gate.set()
    channel = events_channel(f"race-{uuid.uuid4().hex}")
    following = asyncio.ensure_future(subscriber.subscribe(channel))
    await held.asked.wait()  # the follower now waits for Redis's confirmation
    subscriber._dispatch([[b"subscribe", channel.encode(), 2]])  # the confirmation, as the reader hands it over
    following.cancel()  # in the same turn of the loop
    with pytest.raises(asyncio.CancelledError):
        await following


async def test_a_follower_cancelled_while_another_waits_for_the_same_channel_leaves_it_be(
    subscriber: EventSubscriber, raw_redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    await subscriber.subscribe(events_channel(f"warm-{uuid.uuid4().hex}"))
    held = HeldSubscriptions(monkeypatch, send=True)
    channel = events_channel(f"shared-{uuid.uuid4().hex}")
    first = asyncio.ensure_future(subscriber.subscribe(channel))
    await held.asked.wait()
    second = asyncio.ensure_future(subscriber.subscribe(channel))
    await asyncio.sleep(0)  # the second follower waits on the first one's subscription
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    held.gate.set()
    inbox = await asyncio.wait_for(first, timeout=10)
    await raw_redis.publish(channel, b"event")
    assert await asyncio.wait_for(inbox.get(), timeout=10) == b"event"


async def test_a_follower_cancelled_before_its_subscription_is_confirmed_leaves_no_subscription(
    subscriber: EventSubscriber, raw_redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    await subscriber.subscribe(events_channel(f"warm-{uuid.uuid4().hex}"))
    held = HeldSubscriptions(monkeypatch, send=True)
    held.gate.set()
    channel = events_channel(f"abandoned-{uuid.uuid4().hex}")
    following = asyncio.ensure_future(subscriber.subscribe(channel))
    await held.asked.wait()  # SUBSCRIBE sent, its confirmation not read yet
    following.cancel()
    await asyncio.gather(following, return_exceptions=True)
    assert following.cancelled()
    async with asyncio.timeout(10):
        while await numsub(raw_redis, channel) != 0:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # a confirmation still on its way must not revive it
    assert await numsub(raw_redis, channel) == 0


async def test_replies_already_parsed_are_drained_in_one_batch(raw_redis: aioredis.Redis) -> None:
    """The batch drain reads redis-py's private hiredis reader; when an upgrade moves it,
    every message costs its own read again, silently. This notices."""
    channel = events_channel(f"d-{uuid.uuid4().hex}")
    pubsub = raw_redis.pubsub()
    await pubsub.subscribe(channel)
    try:
        assert await pubsub.parse_response(block=True, timeout=5) is not None  # the confirmation
        async with raw_redis.pipeline(transaction=False) as pipe:
            for i in range(50):
                pipe.publish(channel, str(i))
            await pipe.execute()
        await asyncio.sleep(0.2)  # all 50 on the socket before the first read
        first = await pubsub.parse_response(block=True, timeout=5)
        rest = _buffered_replies(pubsub)
        assert [first, *rest] == [[b"message", channel.encode(), str(i).encode()] for i in range(50)]
        assert rest, "nothing came from the parser's buffer: the batch drain is not active"
    finally:
        await pubsub.aclose()


async def test_followers_subscribing_while_redis_restarts_are_all_served() -> None:
    """Followers keep arriving while Redis is killed and comes back on its port, slow to
    answer at first (paused as it starts, so the reader's reconnect hangs mid-handshake
    and times out): each subscribes at a different point of the reader's reconnects. None
    may break the reader (only it reconnects the socket; a follower that reconnected it
    too would race it) or be left unconfirmed: each gets its inbox, and a message
    published after the restart reaches every one, after at most resyncs."""
    with RedisServer() as server:
        settings = redis_settings_for(server.url)
        settings.socket_timeout, settings.health_check_interval = 2.0, 1.0  # the pause outlasts a reply's wait
        redis = await create_pool(settings)
        subscriber = EventSubscriber(redis)
        try:
            await subscriber.subscribe(events_channel(f"warm-{uuid.uuid4().hex}"))
            channels: list[str] = []
            followers = []

            async def follow_for(seconds: float) -> None:
                for _ in range(int(seconds / 0.02)):
                    channels.append(events_channel(f"restart-{len(channels)}-{uuid.uuid4().hex}"))
                    followers.append(asyncio.ensure_future(subscriber.subscribe(channels[-1])))
                    await asyncio.sleep(0.02)

            for _ in range(3):
                await follow_for(0.2)
                await asyncio.to_thread(server.kill)
                await follow_for(0.4)
                await asyncio.to_thread(server.start)
                server.pause()
                await follow_for(2.5)
                server.resume()
            await follow_for(0.5)
            inboxes = await asyncio.wait_for(asyncio.gather(*followers), timeout=60)
            for channel in channels:
                await redis.publish(channel, b"after")
            for inbox in inboxes:
                delivered = [item async for item in _until_published(inbox)]
                assert delivered[-1] == b"after", delivered
                assert all(item is RESYNC for item in delivered[:-1]), delivered
        finally:
            await subscriber.close()
            await close_pool(redis)


async def _until_published(inbox: Inbox) -> AsyncIterator[object]:
    """The inbox's deliveries up to and including the first published message."""
    while True:
        item = await asyncio.wait_for(inbox.get(), timeout=10)
        yield item
        if isinstance(item, bytes):
            return
