"""The claim script's order on a real Redis: lapsed leases first, then strict priority,
stride-scheduled fair share between a band's tenants (by weight), FIFO within a tenant;
deferred jobs only when due; unindexed jobs by a throttled scan of arq's queue; a job
held for the worker that served its prefix, first for that worker within its band, for
the others once its window passed. Jobs are queued with the enqueue script, as the
library does, and cancelled with cancel."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import pytest
import redis.asyncio as aioredis

from streamq.protocol import IN_PROGRESS_PREFIX, JOB_KEY_PREFIX, RETRY_KEY_PREFIX, WAKEUP_CHANNEL
from streamq.protocol.names import affinity_worker_key, running_key, waiting_key
from streamq.protocol.script_calls import Cancel, ClaimJobs, Enqueue, ReleaseAffinity
from streamq.protocol.scripts import Script

LEASE_MS = 3000


@dataclass(frozen=True)
class AffinityCounts:
    """What claims counted: jobs held for their claimer, jobs with keys from the shared
    index, held jobs whose window passed."""

    hits: int = 0
    misses: int = 0
    expired: int = 0

    def __add__(self, other: AffinityCounts) -> AffinityCounts:
        return AffinityCounts(self.hits + other.hits, self.misses + other.misses, self.expired + other.expired)


class Queue:
    """One throw-away queue, with the library's enqueue and the worker's claim."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.name = f"streamq:queue:claim-{uuid.uuid4().hex[:8]}"
        self.weights = f"streamq:tenant-weights-{uuid.uuid4().hex[:8]}"
        self._enqueue = Script(redis, Enqueue)
        self._claim = Script(redis, ClaimJobs)
        self._cancel = Script(redis, Cancel)
        self.ids: set[str] = set()

        self._release = Script(redis, ReleaseAffinity)
        self.affinity = AffinityCounts()

    async def enqueue(
        self,
        request_id: str,
        priority: int = 0,
        tenant: str = "default",
        delay_ms: int = 0,
        *,
        prefixes: list[str] | None = None,
        window_ms: int = 60_000,
        slack: int = 8,
        fraction: float = 0,
        eligible: list[str] | None = None,
    ) -> None:
        """Queue a job as the library does; with ``prefixes``, its affinity keys; with
        ``eligible``, the only workers that may run it."""
        self.ids.add(request_id)
        call = replace(
            self.enqueue_call(request_id, priority, tenant, delay_ms),
            affinity_keys=prefixes or (),
            window_ms=window_ms,
            balance_slack=slack,
            balance_fraction=fraction,
            eligible=eligible or (),
        )
        assert await self._enqueue(call) == 1

    def enqueue_call(self, request_id: str, priority: int = 0, tenant: str = "default", delay_ms: int = 0) -> Enqueue:
        """The library's enqueue of a job on this queue, without affinity."""
        return Enqueue.of_request(
            request_id,
            self.name,
            b"{}",
            expiry_ms=60_000,
            priority=priority,
            tenant=tenant,
            delay_ms=delay_ms,
        )

    async def claim(
        self,
        wanted: int = 1,
        *,
        lease_ms: int = LEASE_MS,
        scan_ms: int = 1000,
        worker: str = "w1",
        running: int = 0,
        free_ttl_ms: int = 60_000,
        wakeup: str = "",
        ahead: int = 0,
    ) -> list[str]:
        """A claim by ``worker``, which runs ``running`` jobs; it takes part in affinity and
        tells the other workers on ``wakeup`` (if given) of jobs it leaves for them; with
        ``ahead``, it takes that many more for its engine's queue where nobody has room."""
        call = self.claim_call(
            worker, wanted, lease_ms=lease_ms, scan_ms=scan_ms, running=running, free_ttl_ms=free_ttl_ms, wakeup=wakeup
        )
        call = replace(call, ahead=ahead)
        claimed = ClaimJobs.reply(await self._claim(call))
        self.affinity += AffinityCounts(claimed.hits, claimed.misses, claimed.expired)
        return [job.job_id for job in claimed.jobs]

    def claim_call(
        self,
        worker: str,
        wanted: int,
        *,
        lease_ms: int = LEASE_MS,
        scan_ms: int = 1000,
        running: int = 0,
        free_ttl_ms: int = 60_000,
        wakeup: str = "",
        spare: int = 0,
    ) -> ClaimJobs:
        return ClaimJobs(
            queue=self.name,
            wanted=wanted,
            lease_ms=lease_ms,
            page=100,
            in_progress_prefix=IN_PROGRESS_PREFIX,
            worker_id=worker,
            weights_key=self.weights,
            scan_interval_ms=scan_ms,
            affinity_worker_ttl_ms=60_000,
            free_ttl_ms=free_ttl_ms,
            running=running,
            spare=spare,
            wakeup_channel=wakeup,
        )

    async def release(self, worker: str) -> int:
        call = ReleaseAffinity(queue=self.name, worker_id=worker, wakeup_channel=WAKEUP_CHANNEL)
        return int(await self._release(call))

    async def claim_each_by(self, worker: str, count: int) -> list[str]:
        """``count`` claims of one job each by ``worker``."""
        return [job_id for _ in range(count) for job_id in await self.claim(worker=worker)]

    async def claim_each(self, count: int) -> list[str]:
        """``count`` claims of one job each, as a worker whose slots free one by one."""
        return [job_id for _ in range(count) for job_id in await self.claim()]

    async def cancel(self, request_id: str) -> str:
        outcome = await self._cancel(Cancel.of_request(request_id, [self.name]))
        return outcome.decode()

    async def keys(self) -> list[str]:
        return sorted(key.decode() for key in await self.redis.keys(self.name + ":*"))


@pytest.fixture
async def queue(raw_redis: aioredis.Redis) -> AsyncIterator[Queue]:
    q = Queue(raw_redis)
    yield q
    ids = q.ids | {"raw-1", "raw-2"}
    job_keys = [prefix + job_id for job_id in ids for prefix in (JOB_KEY_PREFIX, IN_PROGRESS_PREFIX)]
    await raw_redis.delete(*await q.keys(), q.name, q.weights, *job_keys)


async def test_the_most_urgent_priority_first_and_fifo_within_it(queue: Queue) -> None:
    for i in range(3):
        await queue.enqueue(f"low-{i}", priority=10)
    await queue.enqueue("urgent", priority=0)
    await queue.enqueue("very-urgent", priority=-5)
    await queue.enqueue("urgent-2", priority=0)
    assert await queue.claim_each(6) == ["very-urgent", "urgent", "urgent-2", "low-0", "low-1", "low-2"]
    assert await queue.claim() == []


async def test_tenants_take_turns_in_a_band(queue: Queue) -> None:
    for i in range(6):
        await queue.enqueue(f"a-{i}", tenant="bulk")
    for i in range(2):
        await queue.enqueue(f"b-{i}", tenant="interactive")
    order = await queue.claim_each(8)
    assert order[:4] == ["a-0", "b-0", "a-1", "b-1"], order
    assert order[4:] == ["a-2", "a-3", "a-4", "a-5"]


async def test_one_claim_of_many_slots_takes_turns_too(queue: Queue) -> None:
    for i in range(10):
        await queue.enqueue(f"a-{i}", tenant="a")
    for i in range(10):
        await queue.enqueue(f"b-{i}", tenant="b")
    taken = await queue.claim(6)
    assert Counter(job_id[0] for job_id in taken) == {"a": 3, "b": 3}


async def test_weights_share_a_band_in_proportion(queue: Queue) -> None:
    await queue.redis.hset(queue.weights, mapping={"heavy": 3, "broken": -1})
    for i in range(20):
        await queue.enqueue(f"heavy-{i}", tenant="heavy")
        await queue.enqueue(f"light-{i}", tenant="light")
        await queue.enqueue(f"broken-{i}", tenant="broken")  # a weight <= 0 counts as 1
    counts = Counter(job_id.split("-")[0] for job_id in await queue.claim_each(20))
    assert counts == {"heavy": 12, "light": 4, "broken": 4}


async def test_a_tenant_back_from_idle_banks_no_credit(queue: Queue) -> None:
    for i in range(20):
        await queue.enqueue(f"a-{i}", tenant="a")
    await queue.enqueue("b-0", tenant="b")
    assert len(await queue.claim_each(12)) == 12  # b runs once among them, then is idle
    for i in range(1, 9):
        await queue.enqueue(f"b-{i}", tenant="b")
    order = await queue.claim_each(8)
    assert Counter(job_id[0] for job_id in order) == {"a": 4, "b": 4}, order


async def test_the_waiting_set_holds_the_waiting_jobs_of_each_priority(queue: Queue) -> None:
    for i in range(3):
        await queue.enqueue(f"p5-{i}", priority=5, tenant=f"t{i}")
    key = waiting_key(queue.name, 5)
    assert [await queue.redis.zrank(key, f"p5-{i}") for i in range(3)] == [0, 1, 2]
    assert await queue.claim() == ["p5-0"]
    assert await queue.redis.zrank(key, "p5-0") is None
    assert await queue.redis.zrank(key, "p5-2") == 1


async def test_a_cancelled_job_leaves_no_index_entry(queue: Queue) -> None:
    await queue.enqueue("kept", priority=3, tenant="x")
    await queue.enqueue("gone", priority=3, tenant="y")
    await queue.enqueue("later", priority=3, tenant="y", delay_ms=60_000)
    assert await queue.cancel("gone") == "queued"
    assert await queue.cancel("later") == "queued"
    for key in [key for key in await queue.keys() if not key.endswith(":seq")]:
        members = await queue.redis.hkeys(key) if key.endswith(":indexed") else await queue.redis.zrange(key, 0, -1)
        assert b"gone" not in members and b"later" not in members, key
    assert await queue.claim_each(2) == ["kept"]
    # The claim dropped the emptied tenant and band: nothing of the index is left (the
    # claimer's free slots and load are what enqueue reads to route by prefix).
    kept = (":running", ":scan", ":seq", ":free:w1", ":load")
    assert all(key.endswith(kept) for key in await queue.keys()), await queue.keys()


async def test_a_deferred_job_waits_until_due(queue: Queue) -> None:
    await queue.enqueue("later", tenant="a", delay_ms=60_000)
    await queue.enqueue("soon", tenant="a", delay_ms=300)
    await queue.enqueue("now", tenant="a")
    assert await queue.redis.zrank(waiting_key(queue.name, 0), "soon") is None
    assert await queue.claim(5) == ["now"]
    await asyncio.sleep(0.4)
    assert await queue.claim(5) == ["soon"]
    assert await queue.claim(5) == []


async def test_a_lapsed_lease_is_taken_before_the_backlog(queue: Queue) -> None:
    await queue.enqueue("first")
    assert await queue.claim(lease_ms=200) == ["first"]
    for i in range(3):
        await queue.enqueue(f"backlog-{i}", priority=-10)
    await asyncio.sleep(0.3)  # its worker died: the lease lapsed
    assert await queue.claim() == ["first"]
    assert await queue.claim() == ["backlog-0"]


async def test_a_renewed_lease_is_left_to_its_holder(queue: Queue) -> None:
    await queue.enqueue("running")
    assert await queue.claim(lease_ms=200) == ["running"]
    await queue.redis.set(IN_PROGRESS_PREFIX + "running", "w1:1", px=10_000)  # renewed
    await asyncio.sleep(0.3)
    assert await queue.claim() == []
    # Looked at again only when the renewed lease could lapse.
    assert await queue.redis.zscore(running_key(queue.name), "running") > (await queue.redis.time())[0] * 1000 + 5000


async def test_a_handed_back_job_is_taken_at_the_next_claim(queue: Queue) -> None:
    await queue.enqueue("job")
    assert await queue.claim() == ["job"]
    # What the worker's finish_job does when it hands a job back.
    await queue.redis.delete(IN_PROGRESS_PREFIX + "job")
    await queue.redis.zadd(running_key(queue.name), {"job": 0})
    await queue.enqueue("other", priority=-1)
    assert await queue.claim() == ["job"]


async def test_a_retry_deferred_by_arq_waits_for_its_score(queue: Queue) -> None:
    await queue.enqueue("job")
    assert await queue.claim() == ["job"]
    await queue.redis.delete(IN_PROGRESS_PREFIX + "job")
    await queue.redis.zincrby(queue.name, 60_000, "job")  # arq's Retry(defer=60)
    await queue.redis.zadd(running_key(queue.name), {"job": 0})
    assert await queue.claim() == []
    assert await queue.redis.zscore(running_key(queue.name), "job") == await queue.redis.zscore(queue.name, "job")


async def test_a_finished_job_leaves_the_running_set(queue: Queue) -> None:
    await queue.enqueue("job")
    assert await queue.claim(lease_ms=100) == ["job"]
    await queue.redis.zrem(queue.name, "job")  # arq's finish_job
    await queue.redis.delete(IN_PROGRESS_PREFIX + "job")
    await asyncio.sleep(0.2)
    assert await queue.claim() == []
    assert await queue.redis.exists(running_key(queue.name)) == 0


async def test_a_bare_zadd_job_is_found_by_the_throttled_scan(queue: Queue) -> None:
    now_ms = (await queue.redis.time())[0] * 1000
    await queue.redis.zadd(queue.name, {"raw-1": now_ms})
    await queue.enqueue("indexed")
    # The index first; then, with slots left, arq's queue itself.
    assert await queue.claim(3, scan_ms=400) == ["indexed", "raw-1"]
    await queue.redis.zadd(queue.name, {"raw-2": now_ms, "raw-future": now_ms + 60_000})
    assert await queue.claim(3, scan_ms=400) == []  # scanned a moment ago
    await asyncio.sleep(0.5)
    assert await queue.claim(3, scan_ms=400) == ["raw-2"]


async def test_jobs_queued_in_one_millisecond_keep_their_order(queue: Queue) -> None:
    ids = [f"job-{99 - i:02d}" for i in range(40)]  # names in the reverse of their order
    queue.ids.update(ids)
    await Script(queue.redis, Enqueue).pipelined(queue.enqueue_call(request_id, tenant="t") for request_id in ids)
    assert [int(rank) for rank in [await queue.redis.zrank(waiting_key(queue.name, 0), i) for i in ids]] == list(
        range(40)
    )
    assert await queue.claim(40) == ids


async def served_by(queue: Queue, worker: str, prefix: str) -> None:
    """``worker`` served ``prefix`` (a claim made it the affinity worker:
    ``test_a_claim_names_its_worker_for_the_longest_and_the_shortest_key``) and has
    claimed since with slots to spare."""
    await queue.redis.set(affinity_worker_key(queue.name, prefix), worker)
    assert await queue.claim(8, worker=worker) == []


async def test_a_job_is_held_for_the_worker_that_served_its_prefix_until_the_window_passes(queue: Queue) -> None:
    await served_by(queue, "w1", "conv-a")
    await queue.enqueue("follow-up", prefixes=["conv-a-turn-2", "conv-a"], window_ms=300)
    assert await queue.claim(worker="w2") == []
    assert await queue.claim(8, worker="w1") == ["follow-up"]
    assert queue.affinity.hits == 1
    await queue.enqueue("late", prefixes=["conv-a"], window_ms=300)
    assert await queue.claim(worker="w2") == []
    await asyncio.sleep(0.35)
    assert await queue.claim(worker="w2") == ["late"]
    assert queue.affinity.expired == 1 and queue.affinity.misses == 1


async def test_the_longest_known_prefix_routes(queue: Queue) -> None:
    await served_by(queue, "w1", "shared-instructions")
    await served_by(queue, "w2", "conversation")
    await queue.enqueue("next-turn", prefixes=["conversation-turn-2", "conversation", "shared-instructions"])
    assert await queue.claim(worker="w1") == []
    assert await queue.claim(worker="w2") == ["next-turn"]


async def test_a_worker_without_a_free_slot_gets_nothing_held(queue: Queue) -> None:
    await served_by(queue, "w1", "conv")
    await queue.claim(0, worker="w1")  # it claims with no slot free: its free count is 0
    await queue.enqueue("follow-up", prefixes=["conv"])
    assert await queue.claim(worker="w2") == ["follow-up"]
    assert queue.affinity.hits == 0


async def test_a_gone_worker_gets_nothing_held(queue: Queue) -> None:
    await served_by(queue, "w1", "conv")
    await queue.redis.delete(f"{queue.name}:free:w1")  # lapsed: it stopped claiming
    await queue.enqueue("follow-up", prefixes=["conv"])
    assert await queue.claim(worker="w2") == ["follow-up"]


@pytest.mark.parametrize(
    ("affinity_running", "least_running", "fraction", "held"),
    [(11, 3, 0, True), (12, 3, 0, False), (30, 20, 0.5, True), (31, 20, 0.5, False)],
)
async def test_a_job_is_held_for_its_worker_within_the_slack_of_the_least_busy_else_for_the_least_busy(
    queue: Queue, affinity_running: int, least_running: int, fraction: float, held: bool
) -> None:
    """Held for its prefix's worker if it runs at most max(8, fraction x the least busy's)
    jobs more than the least busy worker; else steered to the least busy (a miss)."""
    await served_by(queue, "w1", "conv")
    await queue.claim(8, worker="w1", running=affinity_running)
    await queue.claim(8, worker="w2", running=least_running)
    await queue.enqueue("follow-up", prefixes=["conv"], slack=8, fraction=fraction)
    assert await queue.claim(worker="w2") == ([] if held else ["follow-up"])
    assert queue.affinity.misses == (0 if held else 1)


async def test_requests_no_worker_served_yet_are_spread_over_the_least_busy(queue: Queue) -> None:
    """A burst of first turns would go to the first worker that claims; each is held for
    the least busy worker with a free slot instead, counting the ones held before it."""
    await queue.claim(8, worker="w1")
    await queue.claim(8, worker="w2")
    for i in range(4):
        await queue.enqueue(f"first-turn-{i}", prefixes=[f"conversation-{i}"])
    assert sorted(await queue.claim(8, worker="w1")) == ["first-turn-0", "first-turn-2"]
    assert sorted(await queue.claim(8, worker="w2")) == ["first-turn-1", "first-turn-3"]
    assert queue.affinity == AffinityCounts(hits=0, misses=4)


async def test_held_jobs_never_pass_a_more_urgent_band(queue: Queue) -> None:
    await served_by(queue, "w1", "conv")
    await queue.enqueue("held-low", priority=5, prefixes=["conv"])
    await queue.enqueue("urgent", priority=0)
    await queue.enqueue("held-urgent", priority=0, prefixes=["conv"])
    await queue.enqueue("later", priority=0)
    assert await queue.claim_each_by("w1", 4) == ["held-urgent", "urgent", "later", "held-low"]


async def test_held_jobs_count_against_their_tenants_share(queue: Queue) -> None:
    await served_by(queue, "w1", "conv")
    for i in range(4):
        await queue.enqueue(f"a-{i}", tenant="a")
        await queue.enqueue(f"b-{i}", tenant="b")
    for i in range(4):
        await queue.enqueue(f"a-held-{i}", tenant="a", prefixes=["conv"])
    order = await queue.claim_each_by("w1", 8)
    # the four held jobs first (tenant a's), then tenant b catches up: b's four before a's
    assert order[:4] == [f"a-held-{i}" for i in range(4)]
    assert order[4:] == ["b-0", "b-1", "b-2", "b-3"], order


async def test_a_stopping_worker_gives_its_held_jobs_back_in_their_place(queue: Queue) -> None:
    await served_by(queue, "w1", "conv")
    await queue.enqueue("before", tenant="t")
    await queue.enqueue("held", tenant="t", prefixes=["conv"])
    await queue.enqueue("after", tenant="t")
    assert await queue.release("w1") == 1
    assert await queue.redis.exists(f"{queue.name}:free:w1") == 0
    assert await queue.claim_each_by("w2", 3) == ["before", "held", "after"]
    await queue.enqueue("next", prefixes=["conv"])  # w1 is no longer routed to
    assert await queue.claim(worker="w2") == ["next"]


async def test_a_cancelled_held_job_leaves_nothing_behind(queue: Queue) -> None:
    await served_by(queue, "w1", "conv")
    await queue.enqueue("held", prefixes=["conv"])
    assert await queue.cancel("held") == "queued"
    for key in await queue.keys():
        if key.endswith((":held", ":indexed")):
            assert await queue.redis.hexists(key, "held") == 0, key
        elif not key.endswith((":seq", ":free:w1", ":affinity:conv", ":scan")):
            assert await queue.redis.zscore(key, "held") is None, key
    assert await queue.claim(worker="w1") == []


async def test_a_claim_names_its_worker_for_the_longest_and_the_shortest_key(queue: Queue) -> None:
    await queue.enqueue("turn-3", prefixes=["turn-3", "turn-2", "turn-1", "system"])
    assert await queue.claim(worker="w1") == ["turn-3"]
    keys = ["turn-3", "turn-2", "turn-1", "system"]
    workers = [await queue.redis.get(affinity_worker_key(queue.name, key)) for key in keys]
    assert workers == [b"w1", None, None, b"w1"]


async def test_a_dead_workers_expired_holds_leave_nothing_behind(queue: Queue) -> None:
    await served_by(queue, "w1", "conv")
    await queue.enqueue("held", priority=3, prefixes=["conv"], window_ms=100)  # w1 dies now
    await asyncio.sleep(0.15)
    assert await queue.claim(worker="w2") == ["held"]
    assert queue.affinity.expired == 1
    assert [key for key in await queue.keys() if ":affine" in key or key.endswith(":held")] == []


async def test_spare_slots_beyond_the_claim_are_told_to_enqueue(queue: Queue) -> None:
    """A front end claims its share of its engine's slots and names the others spare."""
    await queue._claim(queue.claim_call("fe-1", 2, spare=5))
    assert await queue.redis.get(f"{queue.name}:free:fe-1") == b"7"


async def test_jobs_taken_for_the_engines_queue_fill_the_spare_slots_first(queue: Queue) -> None:
    """A worker whose batch is full but for a slot an ended request still holds (``spare``)
    takes a job for its engine's queue: that job gets the slot, and enqueue is told of none
    (a follow-up held there would wait behind it)."""
    await queue.enqueue("next")
    call = replace(queue.claim_call("w1", 0, running=2, spare=1), ahead=3)
    assert [job.job_id for job in ClaimJobs.reply(await queue._claim(call)).jobs] == ["next"]
    assert await queue.redis.get(f"{queue.name}:free:w1") == b"0"
    await queue._claim(replace(call, running=3))  # nothing waits: the spare slot is told
    assert await queue.redis.get(f"{queue.name}:free:w1") == b"1"


async def test_an_adapter_with_no_live_affinity_worker_goes_to_the_worker_of_the_fewest(queue: Queue) -> None:
    """New adapters spread by room, not by load: w1 is the worker of two adapters, w2 (busier) none."""
    await queue.claim(8, worker="w1")
    for adapter in ("@sql", "@poet"):  # w1 alone is live
        await queue.enqueue(f"first-{adapter}", prefixes=[adapter])
        assert await queue.claim(8, worker="w1") == [f"first-{adapter}"]
    await queue.claim(8, worker="w2", running=3)
    await queue.enqueue("new-adapter", prefixes=["@pirate"])
    await queue.enqueue("its-next-request", prefixes=["@pirate"])  # before w2 claimed: it follows
    assert await queue.claim(8, worker="w1") == []
    assert sorted(await queue.claim(8, worker="w2", running=3)) == ["its-next-request", "new-adapter"]
    assert sorted(await queue.redis.zrange(f"{queue.name}:adapters:w1", 0, -1)) == [b"@poet", b"@sql"]
    assert await queue.redis.zrange(f"{queue.name}:adapters:w2", 0, -1) == [b"@pirate"]


async def test_an_adapter_taken_elsewhere_for_balance_stays_with_its_live_worker(queue: Queue) -> None:
    """A request steered to the least busy worker runs there once; the adapter's worker, which
    has it loaded, keeps it. A worker that took it over from a gone affinity worker becomes its worker."""
    await queue.enqueue("first", prefixes=["@sql"])
    assert await queue.claim(8, worker="w1") == ["first"]
    await queue.claim(8, worker="w1", running=20)  # w1 far busier than w2
    await queue.claim(8, worker="w2")
    misses = queue.affinity.misses
    await queue.enqueue("balanced", prefixes=["@sql"])
    assert await queue.claim(8, worker="w2") == ["balanced"]
    assert queue.affinity.misses == misses + 1
    assert await queue.redis.get(affinity_worker_key(queue.name, "@sql")) == b"w1"
    await queue.redis.delete(f"{queue.name}:free:w1")  # w1 stopped claiming: gone
    await queue.enqueue("after-w1", prefixes=["@sql"])
    assert await queue.claim(8, worker="w2") == ["after-w1"]
    assert await queue.redis.get(affinity_worker_key(queue.name, "@sql")) == b"w2"
    assert await queue.redis.zrange(f"{queue.name}:adapters:w2", 0, -1) == [b"@sql"]
    assert await queue.redis.zrange(f"{queue.name}:adapters:w1", 0, -1) == []


async def live(queue: Queue, *workers: str) -> None:
    """Each of ``workers`` claims (nothing is queued yet): live, with free slots."""
    for worker in workers:
        await queue.claim(8, worker=worker)


@pytest.mark.parametrize("prefixes", [["@sql"], None], ids=["affinity", "affinity-off"])
async def test_an_adapter_some_workers_serve_goes_only_to_them(queue: Queue, prefixes: list[str] | None) -> None:
    await live(queue, "w1", "w2", "w3")
    await queue.enqueue("sql-job", prefixes=prefixes, eligible=["w2"])
    assert await queue.claim(8, worker="w1") == []
    assert await queue.claim(8, worker="w3") == []
    assert await queue.claim(8, worker="w2") == ["sql-job"]


async def test_a_job_only_some_workers_may_run_is_held_again_for_them_when_its_window_passes(queue: Queue) -> None:
    await live(queue, "w1", "w2")
    await queue.enqueue("sql-job", prefixes=["@sql"], eligible=["w2"], window_ms=100)
    await asyncio.sleep(0.15)  # w2 is slow to claim: the window passes
    assert await queue.claim(8, worker="w1") == []
    assert queue.affinity.expired == 1
    assert await queue.claim(8, worker="w2") == ["sql-job"]


async def test_a_job_whose_workers_are_all_gone_waits_for_one_of_them(queue: Queue) -> None:
    await live(queue, "w1")
    await queue.enqueue("sql-job", prefixes=["@sql"], eligible=["w2"])
    # None of its workers is live: deferred a free-slot key's life (here 100 ms), not indexed.
    assert await queue.claim(8, worker="w1", free_ttl_ms=100) == []
    await live(queue, "w2")  # back: the next claim after that holds the job for it
    await asyncio.sleep(0.15)
    assert await queue.claim(8, worker="w1") == []
    assert await queue.claim(8, worker="w2") == ["sql-job"]


async def test_a_lapsed_lease_of_a_job_only_some_workers_may_run_is_taken_over_by_one_of_them(queue: Queue) -> None:
    await live(queue, "w1", "w2", "w3")
    await queue.enqueue("sql-job", prefixes=["@sql"], eligible=["w1", "w2"])
    claimed = await queue.claim(8, worker="w1", lease_ms=200) + await queue.claim(8, worker="w2", lease_ms=200)
    assert claimed == ["sql-job"]
    await asyncio.sleep(0.3)  # its worker died
    assert await queue.claim(8, worker="w3") == []
    assert await queue.claim(8, worker="w2") + await queue.claim(8, worker="w1") == ["sql-job"]


async def test_a_stopping_worker_gives_a_job_only_some_workers_may_run_to_another_of_them(queue: Queue) -> None:
    await live(queue, "w1", "w2")
    await queue.claim(8, worker="w3", running=5)  # the busier of the two that may run it
    await queue.enqueue("sql-job", prefixes=["@sql"], eligible=["w2", "w3"])
    assert await queue.release("w2") == 1
    assert await queue.claim(8, worker="w1") == []
    assert await queue.claim(8, worker="w3", running=5) == ["sql-job"]


@pytest.fixture
async def wakeups(raw_redis: aioredis.Redis) -> AsyncIterator[tuple[str, aioredis.client.PubSub]]:
    """A wake-up channel of this test's own, subscribed."""
    channel = f"streamq:wakeup-{uuid.uuid4().hex[:8]}"
    pubsub = raw_redis.pubsub()
    await pubsub.subscribe(channel)
    assert (await pubsub.get_message(timeout=1.0))["type"] == "subscribe"
    yield channel, pubsub
    await pubsub.aclose()


async def woken(pubsub: aioredis.client.PubSub) -> list[bytes]:
    """The wake-ups published so far (each names its queue)."""
    messages = []
    while (message := await pubsub.get_message(timeout=0.2)) is not None:
        messages.append(message["data"])
    return messages


async def test_a_claim_that_holds_a_job_for_another_worker_wakes_the_workers(
    queue: Queue, wakeups: tuple[str, aioredis.client.PubSub]
) -> None:
    """Without it, the worker a claim chose would find the job only at its next poll."""
    channel, pubsub = wakeups
    await live(queue, "w1", "w2")
    await queue.enqueue("sql-job", eligible=["w2"])  # made due at once: the next claim holds it
    assert await queue.claim(8, worker="w1", wakeup=channel) == []
    assert await woken(pubsub) == [queue.name.encode()]
    assert await queue.claim(8, worker="w2", wakeup=channel) == ["sql-job"]
    assert await woken(pubsub) == []  # it took what was held for it: nobody else to tell


async def test_a_claim_that_leaves_expired_holds_in_the_index_wakes_the_workers(
    queue: Queue, wakeups: tuple[str, aioredis.client.PubSub]
) -> None:
    channel, pubsub = wakeups
    await served_by(queue, "w1", "conv")
    await queue.claim(8, worker="w2")
    for i in range(2):
        await queue.enqueue(f"held-{i}", prefixes=["conv"], window_ms=100)  # w1 stalls
    await asyncio.sleep(0.15)
    assert await queue.claim(1, worker="w2", wakeup=channel) == ["held-0"]  # its one free slot
    assert await woken(pubsub) == [queue.name.encode()]
    assert await queue.claim(8, worker="w3", wakeup=channel) == ["held-1"]
    assert await woken(pubsub) == []


async def test_a_claim_takes_jobs_for_its_engines_queue_only_beyond_the_other_workers_free_slots(
    queue: Queue,
) -> None:
    """A worker whose engine is full keeps the next jobs waiting inside its engine, so that a
    freed slot is refilled in the same step; but never a job another worker could start."""
    for i in range(6):
        await queue.enqueue(f"job-{i}")
    assert await queue.claim(2, worker="w1", ahead=3) == ["job-0", "job-1", "job-2", "job-3", "job-4"]
    assert await queue.claim(2, worker="w2") == ["job-5"]  # live, a slot still free
    assert await queue.claim(0, worker="w1", ahead=3) == []
    for i in range(6, 9):
        await queue.enqueue(f"job-{i}")
    assert await queue.claim(0, worker="w1", ahead=3) == ["job-6", "job-7"]  # 3 waiting, 1 free at w2
    assert await queue.claim(1, worker="w2") == ["job-8"]


async def test_a_worker_whose_free_slots_lapsed_leaves_no_room_to_count(queue: Queue) -> None:
    await queue.claim(4, worker="gone", free_ttl_ms=50)
    await asyncio.sleep(0.1)
    await queue.enqueue("job")
    assert await queue.claim(0, worker="w1", ahead=1) == ["job"]
    assert await queue.redis.zscore(f"{queue.name}:load", "gone") is None  # dropped on sight


async def test_a_claim_returns_each_jobs_payload_and_counts_its_try_as_arqs_run_job(queue: Queue) -> None:
    job_id = f"job-{uuid.uuid4().hex}"
    await queue.enqueue(job_id)
    claim = Script(queue.redis, ClaimJobs)
    call = queue.claim_call("w1", 1, lease_ms=50)
    (first,) = ClaimJobs.reply(await claim(call)).jobs
    assert (first.job_id, first.payload, first.tries, first.cancelled) == (job_id, b"{}", 1, False)
    await asyncio.sleep(0.1)  # its lease lapses: the next claim takes it over, as its second try
    (again,) = ClaimJobs.reply(await claim(call)).jobs
    assert (again.job_id, again.tries) == (job_id, 2)
    assert 0 < await queue.redis.ttl(RETRY_KEY_PREFIX + job_id) <= 88400
    await queue.redis.delete(JOB_KEY_PREFIX + job_id)
    await asyncio.sleep(0.1)
    (expired,) = ClaimJobs.reply(await claim(call)).jobs
    assert (expired.payload, expired.tries) == (None, 3)  # the runner ends it as expired
