"""Start a small real vLLM engine with kvflow: used by `kvflow demo`, tests and benchmarks.

The tiny model config ships in the `kvflow` package; weights are vLLM's
deterministic dummy weights, so two engine processes with the same config
compute the same KV bytes and the same tokens.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

__all__ = ["GenResult", "generate", "make_llm", "tiny_model_dir"]


def tiny_model_dir() -> str:
    """Directory of the shipped 4-layer Llama config (dummy weights)."""
    return str(resources.files("kvflow") / "data" / "tiny-llama")


@dataclass
class GenResult:
    tokens: list[int]
    seconds: float
    error: str = ""


def make_llm(
    *,
    model: str | None = None,
    connector: str | None = "KVFlowConnector",
    extra_config: dict[str, Any] | None = None,
    kv_role: str = "kv_both",
    failure_policy: str = "recompute",
    block_size: int = 32,
    prefix_caching: bool = False,
    **kwargs: Any,
) -> Any:
    """An `LLM` on the CPU-friendly settings; `connector=None` runs without one."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if connector is not None:
        kv = KVTransferConfig(
            kv_connector=connector,
            kv_role=kv_role,  # type: ignore[arg-type]  # validated by vLLM
            kv_connector_extra_config=dict(extra_config or {}),
            kv_load_failure_policy=failure_policy,  # type: ignore[arg-type]
        )
    args: dict[str, Any] = dict(
        model=model or tiny_model_dir(),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
        max_model_len=2048,
        max_num_seqs=16,
        kv_transfer_config=kv,
        seed=0,
    )
    args.update(kwargs)
    return LLM(**args)


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[GenResult]:
    """Greedy-decode each prompt in one batch; per-request errors are returned, not raised."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
    )
    dt = time.perf_counter() - t0
    results = []
    for o in outs:
        c = o.outputs[0]
        err = "" if c.finish_reason in ("length", "stop") else str(c.finish_reason)
        results.append(GenResult(tokens=list(c.token_ids), seconds=dt, error=err))
    return results
