"""Every script's typed call against the script's own header (its first lines, ``-- KEYS[1]
job_key: ...``): one call per script, whose fields are the header's names, sent to KEYS or
ARGV at the header's positions, with the header's defaults; and no script reads a KEYS or
ARGV position its header does not declare."""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, get_args, get_type_hints

import pytest
import redis.asyncio as aioredis
from redis.connection import Connection

from devkit.redis_server import RedisServer
from streamq.broker.data_plane import CLUSTER, ONE_REDIS, DataNames
from streamq.broker.replay_log import LogEvent, append_call, pack_append
from streamq.protocol.names import events_bucket
from streamq.protocol.script_calls import CALLS, AppendAndPublish, AppendedEvent, ReleaseAffinity, ScriptCall
from streamq.protocol.scripts import Script, script_names, script_source

ENTRY = re.compile(
    r"-- (?P<array>KEYS|ARGV)\[(?:(?P<position>\d+)(?P<variadic>\.\.)?|n\+(?P<after>\d+))\] "
    r"(?P<name>[a-z_]+)(?:\{(?P<members>[^}]+)\})?(?: = (?P<default>'[^']*'|-?\d+|nil|\{\}))?: (?P<text>\S.*)"
)
CONTINUED = re.compile(r"--   \S")
MEMBER = re.compile(r"(?P<name>[a-z_]+)(?: = (?P<default>nil))?")


@dataclass(frozen=True)
class Entry:
    """One line of a header: a key or argument, any number of them, or groups of them."""

    array: str
    name: str
    position: int | None
    """Its position; ``None`` after any number of others (``n+<after>``)."""
    after: int | None
    variadic: bool
    members: tuple[tuple[str, str | None], ...]
    """A group's members, each with its default (``nil`` or none)."""
    default: str | None
    text: str


@dataclass(frozen=True)
class Header:
    entries: tuple[Entry, ...]
    body: str
    """The script below its header, comments left out."""

    def of(self, array: str) -> list[Entry]:
        return [entry for entry in self.entries if entry.array == array]


def parse(name: str) -> Header:
    lines = script_source(name).splitlines()
    entries: list[Entry] = []
    for index, line in enumerate(lines):
        match = ENTRY.fullmatch(line)
        if match:
            members = tuple(
                (found["name"], found["default"])
                for found in (MEMBER.fullmatch(member.strip()) for member in (match["members"] or "").split(","))
                if found
            )
            if match["members"]:
                assert len(members) == len(match["members"].split(",")), f"{name}: a malformed group: {line}"
            entries.append(
                Entry(
                    array=match["array"],
                    name=match["name"],
                    position=int(match["position"]) if match["position"] else None,
                    after=int(match["after"]) if match["after"] else None,
                    variadic=bool(match["variadic"]),
                    members=members,
                    default=match["default"],
                    text=match["text"],
                )
            )
        elif entries and CONTINUED.match(line):
            entries[-1] = replace(entries[-1], text=entries[-1].text + " " + line[2:].strip())
        else:
            assert not line.startswith(("-- KEYS[", "-- ARGV[")), f"{name}: a header line out of place: {line}"
            body = "\n".join(re.sub(r"--.*", "", code) for code in lines[index:])
            return Header(tuple(entries), body)
    raise AssertionError(f"{name}: nothing but a header")


def check_positions(name: str, entries: list[Entry]) -> None:
    """Positions 1, 2, ... in order; at most one ``[i..]``, the rest after it ``[n+1]``,
    ``[n+2]``, ...; an argument left out when absent (``= nil``) only at the end."""
    fixed, after, variadic = 0, 0, False
    for entry in entries:
        where = f"{name}: {entry.array} {entry.name}"
        if entry.after is not None:
            assert variadic and entry.after == after + 1, f"{where}: n+{entry.after} out of place"
            after += 1
        else:
            assert not variadic and entry.position == fixed + 1, f"{where}: position {entry.position} out of order"
            fixed += 1
            variadic = entry.variadic
        assert entry.variadic or not entry.members, f"{where}: a group is any number of them"
    omitted = [entry.default == "nil" for entry in entries]
    assert omitted == sorted(omitted), f"{name}: {entries[0].array} left out when absent, then given"


def literal(text: str) -> Any:
    if text == "nil":
        return None
    if text == "{}":
        return ()
    if text.startswith("'"):
        return text[1:-1]
    return int(text)


def joined(entry: Entry) -> bool:
    return "comma-joined" in entry.text


def group_of(call: type[ScriptCall], name: str) -> Any:
    [group] = get_args(get_type_hints(call)[name])
    return group


def sample(call: type[ScriptCall], header: Header) -> tuple[ScriptCall, list[Any], list[Any]]:
    """A call with a value of its own in each field (two of each list, two groups), and the
    KEYS and ARGV its header says it makes of them."""
    values: dict[str, Any] = {}
    expected: dict[str, list[Any]] = {"KEYS": [], "ARGV": []}
    for entry in header.entries:
        out = expected[entry.array]
        if entry.members:
            group = group_of(call, entry.name)
            if entry.name not in values:
                values[entry.name] = [
                    group(**{member: f"<{entry.name}.{member}#{i}>" for member in group._fields}) for i in range(2)
                ]
            out += [f"<{entry.name}.{member}#{i}>" for i in range(2) for member, _ in entry.members]
        elif entry.variadic or joined(entry):
            values[entry.name] = [f"<{entry.name}#0>", f"<{entry.name}#1>"]
            out += [f"<{entry.name}#0>,<{entry.name}#1>"] if joined(entry) else values[entry.name]
        else:
            values[entry.name] = f"<{entry.name}>"
            out.append(values[entry.name])
    return call(**values), expected["KEYS"], expected["ARGV"]


def test_every_script_has_its_call_and_every_call_its_script() -> None:
    assert sorted(CALLS) == script_names()


@pytest.mark.parametrize("name", script_names())
def test_the_call_sends_what_the_header_says_where_it_says(name: str) -> None:
    header = parse(name)
    assert header.entries, f"{name} has no header"
    for array in ("KEYS", "ARGV"):
        check_positions(name, header.of(array))
    call = CALLS[name]
    assert {field.name for field in fields(call)} == {entry.name for entry in header.entries}
    made, keys, args = sample(call, header)
    assert made.keys() == keys
    assert made.args() == args


@pytest.mark.parametrize("name", script_names())
def test_the_call_has_the_headers_defaults(name: str) -> None:
    header = parse(name)
    call = CALLS[name]
    defaults = {field.name: field.default for field in fields(call)}
    for entry in header.entries:
        default = defaults[entry.name]
        if entry.members:
            group = group_of(call, entry.name)
            assert default is MISSING, f"{name}.{entry.name}"
            for member, member_default in entry.members:
                assert group._field_defaults.get(member, MISSING) == (
                    MISSING if member_default is None else literal(member_default)
                ), f"{name}.{entry.name}.{member}"
        elif entry.default is None:
            assert default is MISSING, f"{name}.{entry.name} has a default its header does not say"
        elif joined(entry):
            assert entry.default == "''" and default == (), f"{name}.{entry.name}"
        else:
            expected = literal(entry.default)
            given = default.decode() if isinstance(default, bytes) else default
            assert given == expected and type(given) is type(expected) or given is None is expected, (
                f"{name}.{entry.name}: {default!r}, its header {entry.default}"
            )


@pytest.mark.parametrize("name", script_names())
def test_the_script_reads_no_position_its_header_leaves_out(name: str) -> None:
    """A literal ``KEYS[i]`` or ``ARGV[i]`` is a declared position (of a list: its first),
    and ``unpack(KEYS, i)`` or ``for _ = i, #ARGV`` starts at the header's list."""
    header = parse(name)
    for array in ("KEYS", "ARGV"):
        entries = header.of(array)
        lists = [entry.position for entry in entries if entry.variadic]
        fixed = sum(1 for entry in entries if entry.position is not None and not entry.variadic)
        read = {int(i) for i in re.findall(rf"\b{array}\[(\d+)\]", header.body)}
        assert max(read, default=0) <= fixed + bool(lists), f"{name} reads {array}{sorted(read)}"
        starts = re.findall(rf"unpack\({array}, (\d+)\)|for \w+ = (\d+), #{array}\b", header.body)
        for start in (int(a or b) for a, b in starts):
            assert start in lists, f"{name} reads {array} from {start}, its header's list from {lists}"


def test_a_left_out_argument_is_only_ever_the_last() -> None:
    events = [AppendedEvent("log", "owner", "0-1", 1, 0, b"{}")]
    with pytest.raises(ValueError, match="left out"):
        AppendAndPublish(maxlen=1, ttl_ms=1, events=events, recent_ends_max=200).keys()


@pytest.mark.parametrize("defer", [False, True], ids=["published", "deferred"])
@pytest.mark.parametrize("names", [ONE_REDIS, CLUSTER], ids=["one Redis", "cluster"])
def test_the_hot_paths_packed_append_is_the_typed_call_as_redis_py_packs_it(names: DataNames, defer: bool) -> None:
    """The worker packs its batches by hand (``pack_append``, one pass: the cost per event);
    the bytes must be the typed call's, deferred too (an end that waits for its replicas)."""
    other = next(f"req-{i}" for i in range(10_000) if events_bucket(f"req-{i}") == events_bucket("req-a"))
    events = [  # on a cluster a call's events are of one bucket
        LogEvent("req-a", 0, 1, b"{}", False),
        LogEvent(other, 8, 2, b"x", True),
        LogEvent("req-a", 1, 1, b'{"t":1}', False),
    ]
    sha = "f" * 40
    call = append_call(100, 60_000, events, 200, names, defer=defer)
    assert (call.publish == "") is defer
    packed = pack_append(sha, 100, 60_000, events, 200, names, defer=defer)
    assert packed == b"".join(Connection().pack_command(*call.command(sha)))


async def test_a_call_whose_script_is_flushed_again_while_it_loads_it_runs_once_loaded() -> None:
    """A worker must not die of a ``SCRIPT FLUSH`` (another client's, a restart): the script
    flushed again between its load and its run, the call loads it again and runs."""
    with RedisServer() as server:
        redis = aioredis.Redis.from_url(server.url)
        flusher = aioredis.Redis.from_url(server.url)
        try:
            script = Script(redis, ReleaseAffinity)
            real_load = redis.script_load

            async def load_then_forget(text: str) -> Any:
                sha = await real_load(text)
                if load_then_forget.calls == 0:
                    await flusher.script_flush()  # forgotten before the run
                load_then_forget.calls += 1
                return sha

            load_then_forget.calls = 0  # type: ignore[attr-defined]
            redis.script_load = load_then_forget  # type: ignore[method-assign]
            call = ReleaseAffinity(queue="q", worker_id="w", wakeup_channel="c")
            await script(call)  # raised NoScriptError before
            assert load_then_forget.calls == 2  # type: ignore[attr-defined]
        finally:
            await redis.aclose()
            await flusher.aclose()
