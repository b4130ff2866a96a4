"""The compatibility matrix's engine rows: what an engine is started with (speculative
decoding, LoRA), on each of kvflow's paths, with identical outputs to
an engine without a connector started the same way (tests/support/compat.py). Each row
starts its own engines: a baseline, a cold and a warm engine, and a P/D pair per
transport.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvflow_vllm.engine_process import EngineFailed, Sampling, model_dir

from ..support.compat import (
    PATHS,
    Case,
    Row,
    assert_same,
    assert_served,
    loaded_tokens,
    pd_pair,
    run_store_row,
    through_pd,
    tier_hits,
)
from ..support.eagle_heads import write_eagle_head
from ..support.lora_adapters import write_adapter
from ..support.mtp_models import write_mimo
from ..support.vllm_engines import run_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

_rng = random.Random(480)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]


REPEATS = (_prompt(20) * 8)[:150]
"""A prompt that repeats itself: an n-gram proposer has drafts to offer."""
PLAIN = _prompt(170)  # 5 full blocks and a partial one
SPEC = {"r": REPEATS, "p": PLAIN}
MAX_TOKENS = 16


def _spec(config: dict[str, Any]) -> dict[str, Any]:
    return {"llm_args": {"speculative_config": config}}


EAGLE = "speculative decoding: EAGLE (a one-layer head, 2 draft tokens)"
MTP = "speculative decoding: MTP (a tiny MiMo model's MTP layer, 1 draft token)"
ROWS: dict[str, dict[str, Any]] = {
    "speculative decoding: n-gram (3 draft tokens)": _spec(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    ),
    "speculative decoding: a draft model (2 draft tokens)": _spec(
        {"model": model_dir("tiny-llama"), "num_speculative_tokens": 2}
    ),
    EAGLE: {},  # its head is written with the row's engines (`_engine`)
    MTP: {},  # its model too
    "LoRA: two adapters and none on one prompt": {
        "llm_args": {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
    },
}
LORA = "LoRA: two adapters and none on one prompt"


def _engine(row: str, tmp: Path) -> dict[str, Any]:
    """The row's Scenario fields; EAGLE's head and MTP's model are written under `tmp`."""
    if row == MTP:
        mtp = {"method": "mtp", "num_speculative_tokens": 1}
        return {"model": write_mimo(tmp / "mimo"), **_spec(mtp)}
    if row != EAGLE:
        return ROWS[row]
    head = write_eagle_head(tmp / "eagle-head", model_dir("tiny-llama"))
    return _spec({"method": "eagle", "model": head, "num_speculative_tokens": 2})


def _cases(row: str, tmp: Path) -> dict[str, Case]:
    if row != LORA:
        return {k: Case(p, max_tokens=MAX_TOKENS) for k, p in SPEC.items()}
    model = model_dir("tiny-llama")
    a, b = write_adapter(tmp / "a", 1, model), write_adapter(tmp / "b", 2, model)
    return {
        "a": Case(PLAIN, Sampling(lora=("a", 1, a))),
        "b": Case(PLAIN, Sampling(lora=("b", 2, b))),
        "none": Case(PLAIN),
    }


@pytest.fixture(scope="module")
def stores(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Row:
    """The row's (`indirect`) baseline, cold and warm engines."""
    tmp = tmp_path_factory.mktemp("compat-engine")
    row = run_store_row(tmp, _cases(request.param, tmp), **_engine(request.param, tmp))
    row.name = request.param
    return row


LORA_PD = (
    "yes, the adapter at the same path on both instances; at another path on the decode "
    "instance, computed there (vLLM keys an adapter by name and path)"
)


def _params(paths: tuple[str, ...]) -> list[Any]:
    def claim(row: str, path: str) -> str:
        return LORA_PD if row == LORA and path in ("zmq", "nixl") else "yes"

    return [
        pytest.param(
            row, path, marks=pytest.mark.cell(row, path, claim=claim(row, path)), id=f"{i}-{path}"
        )
        for i, row in enumerate(ROWS)
        for path in paths
    ]


@pytest.mark.parametrize(("stores", "path"), _params(PATHS), indirect=["stores"], scope="module")
def test_the_engine_on_each_path(stores: Row, path: str, tmp_path: Path) -> None:
    row = stores
    if "a" in row.cases:
        assert row.baseline["a"].tokens != row.baseline["b"].tokens, "the adapters change nothing"
    if path in ("zmq", "nixl"):
        _pd(row, path, tmp_path)
        return
    for name in row.cases:
        assert_same(row.cold[name], row.baseline[name], f"{name}: the engine that saved")
        got = row.warm[name] if path == "fs" else row.tier[name]
        assert_same(got, row.baseline[name], f"{name}: from {path}")
        if path == "fs":
            assert_served(row.cases[name], row.log("warm"), got, name)
        else:
            assert tier_hits(row.log("warm"), got) > 0, f"{name}: the host tier served nothing"


def _pd(row: Row, transport: str, tmp: Path) -> None:
    """Every case of the row through a P/D pair started as the row's engines are. An
    adapter at the same path on both instances is pulled; at another path on the decode
    instance, the prompt is computed there: vLLM keys an adapter by its name and path
    (`kv_cache_utils._gen_lora_extra_hash_keys`: "re-pointing a LoRA name at a different
    adapter" must not reuse KV), and so does kvflow (decision 84)."""
    log = tmp / f"{transport}-consumer.events.jsonl"
    with pd_pair(tmp, transport, **_engine(row.name, tmp)) as (producer, consumer):
        for name, case in row.cases.items():
            got = through_pd(producer, consumer, case)
            assert_same(got, row.baseline[name], f"{name}: decoded over {transport}")
            assert_served(case, log, got, name)
            if not case.sampling.lora:
                continue
            adapter, id_, path = case.sampling.lora
            there = shutil.copytree(path, tmp / f"decoder-{adapter}")
            moved = Sampling(lora=(adapter, id_, str(there)))
            got = through_pd(producer, consumer, case, moved)
            assert_same(got, row.baseline[name], f"{name}: the adapter at another path")
            assert loaded_tokens(log, got) == 0, f"{name}: loaded another path's KV"
        said = consumer.log.read_text(errors="replace")
        if row.name == LORA:
            assert "another prompt (tokens, cache_salt or LoRA)" in said, said[-2000:]


FP8 = '`kv_cache_dtype="fp8"`'
FP8_REFUSED = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"


@pytest.fixture(scope="module")
def fp8_start(tmp_path_factory: pytest.TempPathFactory) -> str:
    """What vLLM said starting an fp8 KV cache engine without a connector ("" if it ran)."""
    if "avx512f" in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has AVX-512: vLLM's CPU build runs fp8 KV caches (a row to add)")
    tmp = tmp_path_factory.mktemp("compat-fp8")
    try:
        fp8 = {"kv_cache_dtype": "fp8"}
        run_engine(tmp, "fp8", batches=[[PLAIN]], connector=False, llm_args=fp8)
    except EngineFailed as exc:
        return exc.log
    return ""


def _not_runnable(row: str, why: str) -> list[Any]:
    """A row's cells, each "not runnable on vLLM's CPU build" and why."""
    claim = f"not runnable on vLLM's CPU build: {why}"
    return [pytest.param(p, marks=pytest.mark.cell(row, p, claim=claim)) for p in PATHS]


@pytest.mark.parametrize("path", _not_runnable(FP8, f'without AVX-512 (vLLM: "{FP8_REFUSED}")'))
def test_an_fp8_kv_cache_is_not_runnable_on_this_cpu(fp8_start: str, path: str) -> None:
    """vLLM itself refuses it, without a connector: kvflow has nothing to show here."""
    assert FP8_REFUSED in fp8_start, fp8_start[-2000:]


ASYNC_OFF = (
    "vLLM turns async scheduling off there (`CpuPlatform.check_and_update_config`: "
    '"async scheduling is not required on CPU"); kvflow under vLLM\'s `AsyncScheduler`: '
    "`tests/pd/test_vllm_scheduler_pd.py`, `tests/connector/test_vllm_scheduler.py`"
)


@pytest.mark.parametrize("path", _not_runnable("async scheduling", ASYNC_OFF))
def test_async_scheduling_is_turned_off_by_vllms_cpu_build(path: str) -> None:
    """An engine asked for async scheduling runs vLLM's synchronous scheduler here: vLLM's
    own config says which one it runs."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=model_dir("tiny-llama"), skip_tokenizer_init=True, async_scheduling=True
    )
    config = args.create_engine_config()
    assert config.scheduler_config.async_scheduling is False, "make async scheduling a row"
