"""kvflow in real vLLM engines on an NVIDIA GPU: `fs` across engine processes and `zmq`
P/D (CUDA IPC), on the KV layout vLLM picks by default and on HND. Skipped without a GPU
(`scripts/gpu-check.sh` runs it where there is one); the same geometry runs on CPU memory
in tests/connector/test_gpu_layouts.py and tests/transports/test_peer_layouts.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvflow.observe.events import BlocksAllocated, LoadStarted, TransferDone

from ..support.vllm_engines import ServingEngine, assert_same_generation, events_for, run_engine

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="real vLLM GPU engines need an NVIDIA GPU; torch.cuda.is_available() is False",
    ),
]

_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (200, 150)]
GPU = {"dtype": "bfloat16", "llm_args": {"gpu_memory_utilization": 0.2}, "block_size": 16}
TOL = 5e-2  # bf16: a recomputed prefill may round differently from the loaded one
LAYOUTS = {"default": {}, "HND": {"VLLM_KV_CACHE_LAYOUT": "LBHNC"}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fs_reuses_prompts_across_gpu_engine_processes(tmp_path: Path, layout: str) -> None:
    def extra(name: str) -> dict[str, object]:
        log = str(tmp_path / f"{name}.events.jsonl")
        return {"options": {"path": str(tmp_path / "cache")}, "event_log": log}

    env = LAYOUTS[layout]
    base = run_engine(tmp_path, "base", batches=[PROMPTS], connector=False, env=env, **GPU)
    cold = run_engine(
        tmp_path, "cold", batches=[PROMPTS], extra_config=extra("cold"), env=env, **GPU
    )
    warm = run_engine(
        tmp_path, "warm", batches=[PROMPTS], extra_config=extra("warm"), env=env, **GPU
    )
    for want, saved, got, prompt in zip(
        base.batches[0], cold.batches[0], warm.batches[0], PROMPTS, strict=True
    ):
        assert_same_generation(saved, want, "cold", TOL)
        assert_same_generation(got, want, "warm", TOL)
        ev = events_for(tmp_path / "warm.events.jsonl", got)
        (load,) = [e for e in ev if isinstance(e, LoadStarted)]
        assert load.tokens == len(prompt), "every prompt token came from the store"
        assert any(isinstance(e, TransferDone) and e.direction == "load" for e in ev), ev


def test_zmq_pd_pulls_device_to_device(tmp_path: Path) -> None:
    def engine(name: str, role: str) -> ServingEngine:
        log = str(tmp_path / f"{name}.events.jsonl")
        return ServingEngine(
            tmp_path, name, kv_role=role, extra_config={"transport": "zmq", "event_log": log}, **GPU
        )

    producer, consumer = engine("producer", "kv_producer"), engine("consumer", "kv_consumer")
    try:
        producer.wait_ready()
        consumer.wait_ready()
        for prompt in PROMPTS:
            reference = producer.ask(prompt, 8)
            prefill = producer.ask(prompt, 1, {"do_remote_decode": True})
            decoded = consumer.ask(prompt, 8, prefill.kv_transfer_params)
            assert_same_generation(decoded, reference, "P/D on a GPU", TOL)
            ev = events_for(tmp_path / "consumer.events.jsonl", decoded)
            (alloc,) = [e for e in ev if isinstance(e, BlocksAllocated)]
            assert alloc.external_tokens == len(prompt), "the whole prompt was pulled"
    finally:
        producer.close()
        consumer.close()
