"""LoRA adapters without an engine: how producers route an adapter's requests
(``Routes``, ``_queue_of``), how ``/v1/models`` lists adapters, the affinity keys of a
request under an adapter, the worker's flags and adapter ids, and the CPU kernels' mend
on vLLM's own torch ops (``worker/lora_plugin.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import msgspec
import pytest

from producer.client import _queue_of as queue_of_model
from producer.errors import NoLiveWorker, UnknownModel
from producer.openai_api.responses import model_list
from streamq.broker.registry import Routes
from streamq.protocol import AdapterCard, WorkerRegistration, decode_registration, encode_registration
from streamq.protocol.affinity import MAX_AFFINITY_KEYS, adapter_key, prompt_keys, under_adapter

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    import torch
    from vllm.lora.ops.torch_ops import lora_ops

    from worker.adapters import adapter_id
    from worker.lora_plugin import _without_negative_indices
    from worker.startup import build_parser, lora_modules_from_args

SQL = AdapterCard(name="sql", path="/adapters/sql")
LORA_WORKER = WorkerRegistration(
    worker_id="w1", model="base", queue="q:lora", max_model_len=512, slots=8, adapters=(SQL,), loads_adapters=True
)
PLAIN_WORKER = WorkerRegistration(worker_id="w2", model="other", queue="q:other", max_model_len=1024, slots=4)


def _queue_of(routes: Routes, model: str) -> str:
    """The queue ``submit`` picks for ``model``, with no model declared and none remembered."""
    return queue_of_model(routes, model, memory_s=0, declared={})


def routes(*workers: WorkerRegistration, known: dict[str, str] | None = None) -> Routes:
    return Routes(workers=list(workers), known_models=known or {})


def test_an_adapter_is_a_live_model_on_its_base_models_queue_with_its_workers_limits() -> None:
    seen = routes(LORA_WORKER, PLAIN_WORKER)
    assert seen.live_models() == {"base": "q:lora", "sql": "q:lora", "other": "q:other"}
    assert seen.is_base_model("base") and not seen.is_base_model("sql")
    assert (seen.context_length("sql"), seen.slots("sql")) == (512, 8)
    assert seen.adapter_queues() == {"q:lora"}


def test_a_request_for_an_adapter_names_the_workers_of_its_queue_that_serve_it_only_when_some_do_not() -> None:
    listing = msgspec.structs.replace(LORA_WORKER, worker_id="w3", loads_adapters=False)
    poet = AdapterCard(name="poet", path="/adapters/poet")
    other_set = msgspec.structs.replace(LORA_WORKER, worker_id="w4", adapters=(poet,), loads_adapters=False)
    assert routes(LORA_WORKER, listing, PLAIN_WORKER).adapter_workers("sql", "q:lora") == []  # all of them do
    mixed = routes(LORA_WORKER, listing, other_set, PLAIN_WORKER)
    assert mixed.adapter_workers("sql", "q:lora") == ["w1", "w3"]
    assert mixed.adapter_workers("poet", "q:lora") == ["w1", "w4"]  # w1 loads adapters by name
    assert mixed.adapter_workers("found-later", "q:lora") == ["w1"]


def test_a_model_nobody_lists_goes_to_the_one_queue_whose_workers_load_adapters() -> None:
    assert _queue_of(routes(LORA_WORKER, PLAIN_WORKER), "found-later") == "q:lora"
    with pytest.raises(UnknownModel, match="nope"):
        _queue_of(routes(PLAIN_WORKER), "nope")
    with pytest.raises(NoLiveWorker):
        _queue_of(routes(PLAIN_WORKER, known={"gone": "q:gone"}), "gone")


def test_with_several_queues_loading_adapters_a_name_goes_where_it_was_served_or_is_refused() -> None:
    elsewhere = msgspec.structs.replace(LORA_WORKER, worker_id="w3", model="base2", queue="q:lora2", adapters=())
    both = routes(LORA_WORKER, elsewhere, known={"served-before": "q:lora2"})
    assert _queue_of(both, "served-before") == "q:lora2"
    with pytest.raises(UnknownModel, match="several queues"):
        _queue_of(both, "never-seen")


def test_a_registration_with_adapters_round_trips_and_one_without_still_reads() -> None:
    assert decode_registration(encode_registration(LORA_WORKER)) == LORA_WORKER
    older = b'{"worker_id":"w","model":"m","queue":"q","v":1}'
    assert decode_registration(older).adapters == () and not decode_registration(older).loads_adapters


def test_v1_models_lists_an_adapter_as_vllm_serve_does_and_a_keys_list_filters_adapters() -> None:
    twin = msgspec.structs.replace(LORA_WORKER, worker_id="w4")
    cards = {card["id"]: card for card in model_list([LORA_WORKER, twin])["data"]}
    assert cards["sql"] == {
        "id": "sql",
        "object": "model",
        "created": 0,
        "owned_by": "streamq",
        "root": "/adapters/sql",
        "parent": "base",
        "workers": 2,
    }
    assert cards["base"]["root"] == "base" and "parent" not in cards["base"]
    only_sql = model_list([LORA_WORKER], allows=lambda model: model == "sql")["data"]
    assert [card["id"] for card in only_sql] == ["sql"]


def test_keys_under_an_adapter_are_its_own_and_end_with_the_adapters_key() -> None:
    text_keys = prompt_keys("x" * 4096)
    keys = under_adapter("sql", text_keys)
    assert keys[-1] == adapter_key("sql")
    assert not set(keys) & set(text_keys), "a prefix under an adapter shares no cache with the base model's"
    assert not set(keys) & set(under_adapter("poet", text_keys))
    assert len(under_adapter("sql", [f"{i:016x}" for i in range(MAX_AFFINITY_KEYS)])) == MAX_AFFINITY_KEYS
    assert under_adapter("sql", []) == [adapter_key("sql")], "a short prompt still finds the adapter's worker"


def test_adapter_ids_are_positive_and_the_same_in_every_process() -> None:
    """Front ends of one engine core load adapters each: they must agree on the ids."""
    code = "from worker.adapters import adapter_id; print(adapter_id('sql'))"
    elsewhere = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert int(elsewhere.stdout) == adapter_id("sql")
    assert adapter_id("sql") != adapter_id("poet")
    assert all(0 < adapter_id(f"a{i}") < 2**31 for i in range(1000))


def test_lora_modules_are_parsed_as_vllm_serve_parses_them_and_need_enable_lora() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["--enable-lora", "--lora-modules", "sql=/a/sql", '{"name": "poet", "path": "/a/poet", "base_model_name": "b"}']
    )
    assert [(m.name, m.path, m.base_model_name) for m in lora_modules_from_args(args) or []] == [
        ("sql", "/a/sql", None),
        ("poet", "/a/poet", "b"),
    ]
    with pytest.raises(SystemExit, match="needs --enable-lora"):
        lora_modules_from_args(parser.parse_args(["--lora-modules", "sql=/a/sql"]))


def test_a_token_under_no_adapter_gets_none_from_the_mended_ops_and_the_last_slot_from_vllms() -> None:
    torch.manual_seed(0)
    weights = torch.randn(2, 1, 4, 6)  # two adapter slots, rank 4, hidden 6
    inputs = torch.randn(3, 6)
    indices = torch.tensor([0, -1, 1])  # the middle token runs under no adapter
    vllms, mended = torch.zeros(3, 4), torch.zeros(3, 4)
    lora_ops.bgmv_shrink(inputs, weights, vllms, indices)
    _without_negative_indices(lora_ops.bgmv_shrink)(inputs, weights, mended, indices)
    last_slot = inputs[1] @ weights[1, 0].T
    assert torch.allclose(vllms[1], last_slot), "vLLM's CPU op applies the last adapter to it"
    assert torch.equal(mended[1], torch.zeros(4))
    assert torch.equal(mended[[0, 2]], vllms[[0, 2]]), "tokens under an adapter are left as they were"
