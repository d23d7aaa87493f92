"""The data plane's names on a Redis Cluster (PROTOCOL.md, "On a Redis Cluster"): a
request's log, owner key, channel and recent-ends list share one slot, the 16 bucket tags
spread over the slot space, and the names a client in another language computes from the
documented table are the ones streamq uses."""

from __future__ import annotations

import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from redis.crc import key_slot

from streamq.broker.data_plane import CLUSTER, ONE_REDIS
from streamq.environment import check_events_url
from streamq.protocol import events_channel, owner_key
from streamq.protocol.names import EVENTS_BUCKET_TAGS, RECENT_ENDS_KEY

PROTOCOL = (Path(__file__).parents[2] / "PROTOCOL.md").read_text()


@pytest.mark.parametrize("request_id", ["req-42", "a.b:c-1", "x" * 128])
def test_a_requests_names_share_one_slot_and_give_back_its_id(request_id: str) -> None:
    names = [CLUSTER.events(request_id), CLUSTER.owner(request_id), CLUSTER.recent_ends(request_id)]
    assert len({key_slot(name.encode()) for name in names}) == 1
    assert CLUSTER.request_id(CLUSTER.events(request_id)) == request_id
    assert CLUSTER.request_id(CLUSTER.events(request_id).encode()) == request_id


def test_one_redis_keeps_the_names_of_today() -> None:
    assert (ONE_REDIS.events("r1"), ONE_REDIS.owner("r1")) == (events_channel("r1"), owner_key("r1"))
    assert ONE_REDIS.all_recent_ends() == [RECENT_ENDS_KEY]
    assert (ONE_REDIS.publish_command, CLUSTER.publish_command) == ("PUBLISH", "SPUBLISH")


def test_each_bucket_tag_hashes_into_its_own_sixteenth_of_the_slots() -> None:
    assert [key_slot(tag.encode()) * 16 // 16384 for tag in EVENTS_BUCKET_TAGS] == list(range(16))
    assert len(set(CLUSTER.all_recent_ends())) == 16


def test_the_documented_table_and_example_name_what_streamq_uses() -> None:
    table = re.search(r"`EVENTS_BUCKET_TAGS = ([\d ]+)`", PROTOCOL)
    assert table is not None and tuple(table.group(1).split()) == EVENTS_BUCKET_TAGS
    bucket = zlib.crc32(b"req-42") % 16
    assert f'`crc32("req-42") % 16 = {bucket}`, tag `{EVENTS_BUCKET_TAGS[bucket]}`' in PROTOCOL
    assert f"SSUBSCRIBE '{CLUSTER.events('req-42')}'" in PROTOCOL


@pytest.mark.parametrize("url", ["redis://localhost:6379", "rediss://h:6380", "redis+sentinel://h:26379/m"])
def test_an_events_url_that_names_no_cluster_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="Redis Cluster"):
        check_events_url(url)
    assert check_events_url("") is None and check_events_url(None) is None
    assert check_events_url("redis+cluster://a:1,b:2") == "redis+cluster://a:1,b:2"


@pytest.mark.parametrize("command", [["producer", "hi"], ["gateway"]])
def test_a_command_given_an_events_url_that_names_no_cluster_says_so(command: list[str]) -> None:
    module, *rest = command
    result = subprocess.run(
        [sys.executable, "-m", module, "--events-redis-url", "redis://localhost:6379", *rest],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "--events-redis-url" in result.stderr and "is a Redis Cluster" in result.stderr
