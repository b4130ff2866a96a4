"""vLLM's `extract_hidden_states` method with kvflow, on a real engine.

Its cache-only layer shares the attention layers' KV cache group, so the group's
layers have different specs; kvflow's scheduler and workers must still agree on the
group's keys. kvflow stores each finished request's hidden states and returns where
they are in `kv_transfer_params`; they must be the model's own: the same rows that
Hugging Face transformers computes from the same weights."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvflow.hidden_states import PARAM, HiddenStatesReader
from kvflow.observe.events import TransferDone
from kvflow_vllm.engine_process import ScenarioResult, tiny_model_dir

from ..support.vllm_engines import assert_same_generation, events_for, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

_rng = random.Random(19)
PROMPT = [_rng.randrange(3, 1000) for _ in range(200)]
SPECULATIVE = {
    "method": "extract_hidden_states",
    "num_speculative_tokens": 1,
    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}},
}


def reference_rows(tokens: list[int], layer_ids: list[int]) -> torch.Tensor:
    """What vLLM's aux hidden state `i` is (the input of decoder layer i), from Hugging
    Face transformers' forward of the same weights: `[tokens, layers, hidden]`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), torch_dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    return torch.stack([out.hidden_states[i][0] for i in layer_ids], dim=1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ScenarioResult]:
    """One engine: PROMPT computed (cold), PROMPT again (warm: loaded from the store), a
    prefix of it with its output tokens' rows; the store is the next test's too."""
    tmp = tmp_path_factory.mktemp("hidden")
    res = run_engine(
        tmp,
        "export",
        batches=[[PROMPT], [PROMPT], [PROMPT[:77]]],
        batch_params=[{}, {}, {"include_output_tokens": True}],
        max_tokens=4,
        extra_config={"options": {"path": str(tmp / "store")}, "event_log": str(tmp / "ev.jsonl")},
        llm_args={"speculative_config": SPECULATIVE},
    )
    return tmp, res


def test_hidden_states_are_stored_and_read_back_by_request(
    exported: tuple[Path, ScenarioResult],
) -> None:
    tmp_path, res = exported
    store = tmp_path / "store"
    (cold,), (warm,), (outputs,) = res.batches
    for r in (cold, warm, outputs):  # what `kvflow inspect` shows as an export
        done = [
            e
            for e in events_for(tmp_path / "ev.jsonl", r)
            if isinstance(e, TransferDone) and e.what == "hidden_states"
        ]
        assert len(done) == 1 and done[0].direction == "save", done
    assert warm.cached_tokens == len(PROMPT) - 1, "the second request did not hit"
    layer_ids = SPECULATIVE["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    want = reference_rows(PROMPT, layer_ids)
    with HiddenStatesReader("fs", {"path": str(store)}, timeout_s=5.0) as reader:
        for r in (cold, warm):  # computed, then loaded with the prompt's KV from the store
            assert r.kv_transfer_params is not None and PARAM in r.kv_transfer_params
            got = reader.load(r.kv_transfer_params)
            assert got.token_ids.tolist() == PROMPT
            torch.testing.assert_close(got.hidden_states, want, rtol=1e-3, atol=1e-3)
        assert outputs.kv_transfer_params is not None
        got = reader.load(outputs.kv_transfer_params)
    tokens = PROMPT[:77] + outputs.tokens[:-1]  # the last token was never an input
    assert got.token_ids.tolist() == tokens
    torch.testing.assert_close(
        got.hidden_states, reference_rows(tokens, layer_ids), rtol=1e-3, atol=1e-3
    )
    # the same prompt's chunks are stored once: KV and hidden states in their namespaces
    assert len([d for d in store.iterdir() if d.is_dir()]) == 2


def test_a_prompt_saved_under_extract_hidden_states_is_loaded_again(
    exported: tuple[Path, ScenarioResult],
) -> None:
    """Saved by one engine (its shutdown drains the save), loaded by the next: a second
    request in the same engine could look up before the first one's save is stored.
    (The first engine is `exported`'s: its cold request's tokens are the reference.)"""
    tmp_path, res = exported
    store = tmp_path / "store"
    (first,) = res.batches[0]
    ((second,),) = run_engine(
        tmp_path,
        "reload",
        batches=[[PROMPT]],
        max_tokens=4,
        extra_config={"options": {"path": str(store)}},
        llm_args={"speculative_config": SPECULATIVE},
    ).batches
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(PROMPT) - 1, "the second engine did not hit"
    assert_same_generation(second, first, "loaded under extract_hidden_states")
    # the scheduler's transport and the worker's use one KV namespace (next to the
    # hidden states' own)
    kv = [d for d in store.iterdir() if d.is_dir() and any(d.glob("*/*.tp0of1pp0.kv"))]
    assert len(kv) == 1


def test_through_vllms_openai_server_as_the_docs_say(tmp_path: Path) -> None:
    """docs/models.md's server command: a completion's `kv_transfer_params` say where its
    hidden states are; the reader loads them."""
    import json

    from kvflow_vllm.apiserver import ApiServer

    store = tmp_path / "store"
    kv = {
        "kv_connector": "KVFlowConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"transport": "fs", "options": {"path": str(store)}},
    }
    doc = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    assert f"--speculative-config '{json.dumps(SPECULATIVE, separators=(',', ':'))}'" in doc
    server = ApiServer(tmp_path, "server", kv, "--speculative-config", json.dumps(SPECULATIVE))
    try:
        server.wait_ready()
        out = server.completion(PROMPT[:50], 2)
        params = out["kv_transfer_params"]
        # read while the server runs: vLLM's default `--shutdown-timeout 0` kills the
        # engine at SIGTERM, with whatever it was still writing (docs/models.md)
        with HiddenStatesReader("fs", {"path": str(store)}) as reader:
            got = reader.load(params)
    finally:
        server.close()
    layer_ids = SPECULATIVE["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    torch.testing.assert_close(
        got.hidden_states, reference_rows(PROMPT[:50], layer_ids), rtol=1e-3, atol=1e-3
    )


def test_tensor_parallel_2_stores_one_copy_and_returns_every_block(tmp_path: Path) -> None:
    """Every rank holds all hidden states; rank 0 writes them, rank 1 hands its blocks
    back at once: the engine runs on (a block leaked by a rank would hang the batch)."""
    store = tmp_path / "store"
    res = run_engine(
        tmp_path,
        "tp2",
        batches=[[PROMPT, PROMPT[:90]], [PROMPT[:60]]],
        max_tokens=2,
        tensor_parallel_size=2,
        extra_config={"options": {"path": str(store)}},
        llm_args={"speculative_config": SPECULATIVE},
    )
    layer_ids = SPECULATIVE["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    with HiddenStatesReader("fs", {"path": str(store)}, timeout_s=5.0) as reader:
        for r, prompt in zip(
            [*res.batches[0], *res.batches[1]], [PROMPT, PROMPT[:90], PROMPT[:60]], strict=True
        ):
            assert r.kv_transfer_params is not None
            got = reader.load(r.kv_transfer_params)
            torch.testing.assert_close(
                got.hidden_states, reference_rows(prompt, layer_ids), rtol=1e-3, atol=1e-3
            )
    hidden = [d for d in store.iterdir() if d.is_dir() and any(d.glob("*/*.hidden.kv"))]
    assert len(hidden) == 1 and not list(hidden[0].glob("*/*.tp*")), "one copy, rank 0's"
