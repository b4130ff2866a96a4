"""Start a small real vLLM engine with kvflow: used by `kvflow demo`, tests and benchmarks.

The tiny model config ships in the `kvflow` package; its weights are seeded
random tensors written once under the user's cache dir, so two engine
processes compute the same KV bytes and the same tokens.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "EngineFailed",
    "GenResult",
    "Sampling",
    "Scenario",
    "ScenarioResult",
    "generate",
    "make_llm",
    "model_dir",
    "run_scenario",
    "spawn_engine",
]


def tiny_model_dir() -> str:
    """The 4-layer, 256-hidden test model (see `model_dir`)."""
    return model_dir("tiny-llama")


def model_dir(name: str) -> str:
    """A shipped Llama config (`tiny-llama`, `tiny-swa`, `bench-llama`) with seeded random weights,
    materialised once per user.

    vLLM's `load_format="dummy"` weights are uniform in +-1e-3, which makes every
    next-token distribution nearly flat: generated tokens would barely depend on
    the KV cache, a weak check of a KV connector. These weights (normal, std 0.05,
    seed 0) give peaked, prompt-dependent outputs, so wrong KV bytes show up as
    different tokens and log-probabilities.
    """
    import json

    from kvflow.config import default_cache_dir

    src = resources.files("kvflow") / "data" / name / "config.json"
    config = json.loads(src.read_text())
    tag = hashlib.blake2b(src.read_bytes() + _WEIGHTS_RECIPE.encode(), digest_size=6).hexdigest()
    out = default_cache_dir() / "models" / f"{name}-{tag}"
    if not (out / "model.safetensors").exists():
        _write_weights(out, config)
    if not (out / "tokenizer.json").exists():
        _write_tokenizer(out, config["vocab_size"])
    return str(out)


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE over `vocab_size` ids (0-2: <unk>, <s>, </s>), so vLLM's OpenAI
    server (which needs a tokenizer) serves the model. Trained on a fixed corpus: any
    text encodes, and the same text gives the same ids in every process."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = [
        "".join(rng.choice("etaoinshrdlucmfwypvbgk") for _ in range(rng.randrange(2, 9)))
        for _ in range(3000)
    ]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) + "." for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tmp = out / f"tokenizer.tmp{os.getpid()}"
    fast.save_pretrained(str(tmp))
    # tokenizer.json last: its presence says the tokenizer is complete
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == "tokenizer.json"):
        os.replace(f, out / f.name)
    tmp.rmdir()


_WEIGHTS_RECIPE = "normal(0,0.05) seed=0 norms=1"


def _write_weights(out: Path, config: dict[str, Any]) -> None:
    import json

    import torch
    from safetensors.torch import save_file

    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    vocab = config["vocab_size"]
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(q, h)
        w[p + "self_attn.k_proj.weight"] = rand(kv, h)
        w[p + "self_attn.v_proj.weight"] = rand(kv, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, q)
        w[p + "mlp.gate_proj.weight"] = rand(inter, h)
        w[p + "mlp.up_proj.weight"] = rand(inter, h)
        w[p + "mlp.down_proj.weight"] = rand(h, inter)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = torch.randn(vocab, h, generator=g) * 0.2
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"model.safetensors.tmp{os.getpid()}"
    save_file({k: v.contiguous() for k, v in w.items()}, str(tmp))
    (out / "config.json").write_text(json.dumps(config))
    os.replace(tmp, out / "model.safetensors")


class GenResult(msgspec.Struct):
    request_id: str
    tokens: list[int]
    logprobs: list[float]
    """Log-probability of each generated token: a sensitive check that KV bytes are right."""
    seconds: float
    error: str = ""
    ttft_s: float = 0.0
    """vLLM's own first-token latency for the request (arrival to first token)."""
    kv_transfer_params: dict[str, Any] | None = None
    cached_tokens: int = 0
    """Prompt tokens vLLM did not compute: its prefix cache's hits plus a connector's."""
    samples: list[list[int]] = []
    """Every completion's tokens where the request asked for more than one (`n`, beams)."""
    prompt_logprobs: list[float] = []
    """Log-probability of each prompt token after the first, where the request asked."""


class Sampling(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a request asks beyond greedy decoding of one completion."""

    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    prompt_logprobs: bool = False
    structured: dict[str, Any] | None = None
    """`StructuredOutputsParams(**structured)`, e.g. `{"json": schema}`, `{"choice": [...]}`."""
    lora: tuple[str, int, str] | None = None
    """The request's LoRA adapter: name, id, path."""
    beam_width: int = 0
    """Beam search (`LLM.beam_search`) of this width instead of sampling."""


class Scenario(msgspec.Struct, forbid_unknown_fields=True):
    """One engine process: start it, run batches of prompts in order, report."""

    batches: list[list[list[int]]]
    connector: bool = True
    extra_config: dict[str, Any] = {}
    kv_role: str = "kv_both"
    failure_policy: str = "recompute"
    max_tokens: int = 8
    one_by_one: bool = False
    """Run each prompt alone (for per-request TTFT) instead of the batch at once."""
    model: str = ""
    connector_name: str = "KVFlowConnector"
    block_size: int = 32
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    """"bfloat16" or "float16" on a GPU (its attention backends take no float32)."""
    llm_args: dict[str, Any] = {}
    """More `LLM(...)` arguments (e.g. `gpu_memory_utilization` for two engines on a GPU)."""
    env: dict[str, str] = {}
    """Environment of the engine (e.g. `VLLM_KV_CACHE_LAYOUT`), set before it starts."""
    batch_params: list[dict[str, Any]] = []
    """`kv_transfer_params` of each batch's requests, in batch order (none past the list)."""
    batch_sampling: list[Sampling] = []
    """How each batch's requests sample, in batch order (greedy past the list)."""


class ScenarioResult(msgspec.Struct):
    startup_s: float
    batches: list[list[GenResult]]


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
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
        max_model_len=2048,
        max_num_seqs=16,
        kv_transfer_config=kv,
        seed=0,
        disable_log_stats=False,  # per-request first-token latency
    )
    args.update(kwargs)
    if isinstance(events := args.get("kv_events_config"), dict):  # LLM takes no dict for it
        from vllm.config import KVEventsConfig

        args["kv_events_config"] = KVEventsConfig(**events)
    return LLM(**args)


def generate(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: int = 8,
    kv_transfer_params: dict[str, Any] | None = None,
    sampling: Sampling | None = None,
) -> list[GenResult]:
    """Decode the prompts in one batch, greedily unless `sampling` says otherwise;
    per-request errors are returned, not raised."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import StructuredOutputsParams

    sampling = sampling or Sampling()
    if sampling.beam_width:
        return _beam_search(llm, prompts, max_tokens, sampling)
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    structured = sampling.structured
    params = SamplingParams(
        max_tokens=max_tokens,
        n=sampling.n,
        temperature=sampling.temperature,
        seed=sampling.seed,
        ignore_eos=structured is None,  # a grammar ends where it ends
        logprobs=1,
        prompt_logprobs=1 if sampling.prompt_logprobs else None,
        structured_outputs=StructuredOutputsParams(**structured) if structured else None,
        extra_args=extra,
    )
    lora = LoRARequest(*sampling.lora) if sampling.lora else None
    t0 = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
        params,
        use_tqdm=False,
        lora_request=lora,
    )
    dt = time.perf_counter() - t0
    results = []
    for o in outs:
        c = o.outputs[0]
        lps = [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs or [], strict=False)]
        err = "" if c.finish_reason in ("length", "stop") else str(c.finish_reason)
        ttft = float(getattr(o.metrics, "first_token_latency", 0.0) or 0.0)
        prompt_lps = [  # the first token has none
            float(lp[t].logprob)
            for t, lp in zip(o.prompt_token_ids or [], o.prompt_logprobs or [], strict=False)
            if lp is not None
        ]
        results.append(
            GenResult(
                o.request_id,
                list(c.token_ids),
                lps,
                dt,
                err,
                ttft,
                o.kv_transfer_params,
                int(o.num_cached_tokens or 0),
                samples=[list(x.token_ids) for x in o.outputs] if sampling.n > 1 else [],
                prompt_logprobs=prompt_lps,
            )
        )
    return results


def _beam_search(
    llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int, sampling: Sampling
) -> list[GenResult]:
    """`LLM.beam_search` of the prompts: each result's `samples` are its beams' tokens
    (best first), its `tokens` the best beam's, its `logprobs` that beam's cumulative
    log-probability, its `request_id` the range of ids of the requests vLLM made for it
    (`first:end`). vLLM runs a beam search as a request per step and beam, each a prompt
    that extends the last: a connector sees every one of them."""
    from vllm.sampling_params import BeamSearchParams

    first = llm.request_counter.counter  # the ids of the requests it makes, one per step
    t0 = time.perf_counter()
    outs = llm.beam_search(
        [{"prompt_token_ids": list(p)} for p in prompts],
        BeamSearchParams(beam_width=sampling.beam_width, max_tokens=max_tokens, ignore_eos=True),
    )
    dt = time.perf_counter() - t0
    results = []
    for p, o in zip(prompts, outs, strict=True):
        beams = [list(s.tokens[len(p) :]) for s in o.sequences]
        logprob = float(o.sequences[0].cum_logprob)
        ids = f"{first}:{llm.request_counter.counter}"
        results.append(GenResult(ids, beams[0], [logprob], dt, samples=beams))
    return results


def _start(sc: Scenario) -> Any:
    """The scenario's engine, warmed up (the first forward pays one-off costs)."""
    os.environ.update(sc.env)
    if sc.tensor_parallel_size > 1:  # vllm-cpu: one core per rank, or it refuses to start
        n = os.cpu_count() or 1
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND",
            "|".join(str(r % n) for r in range(sc.tensor_parallel_size)),
        )
    llm = make_llm(
        model=sc.model or None,
        connector=sc.connector_name if sc.connector else None,
        extra_config=sc.extra_config,
        kv_role=sc.kv_role,
        failure_policy=sc.failure_policy,
        block_size=sc.block_size,
        tensor_parallel_size=sc.tensor_parallel_size,
        **({"dtype": sc.dtype} | sc.llm_args),
    )
    generate(llm, [[1, 2, 3]], 1)
    return llm


def run_scenario(sc: Scenario) -> ScenarioResult:
    t0 = time.perf_counter()
    llm = _start(sc)
    startup = time.perf_counter() - t0
    batches = []
    for i, prompts in enumerate(sc.batches):
        kv = sc.batch_params[i] if i < len(sc.batch_params) else None
        how = sc.batch_sampling[i] if i < len(sc.batch_sampling) else None
        if sc.one_by_one:
            batches.append([generate(llm, [p], sc.max_tokens, kv, how)[0] for p in prompts])
        else:
            batches.append(generate(llm, prompts, sc.max_tokens, kv, how))
    _shutdown(llm)
    return ScenarioResult(startup_s=startup, batches=batches)


class EngineFailed(RuntimeError):
    """An engine process exited non-zero; `log` holds its output."""

    def __init__(self, name: str, returncode: int, log: str) -> None:
        super().__init__(f"the {name} engine process exited with {returncode}")
        self.log = log


def spawn_engine(tmp: Path, name: str, sc: Scenario, timeout: float = 600) -> ScenarioResult:
    """Run `sc` in a fresh engine process (`python -m kvflow_vllm.engine_process`)."""
    import subprocess

    spec, out, log = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec.write_bytes(msgspec.json.encode(sc))
    with open(log, "wb") as f:
        rc = subprocess.run(
            [sys.executable, "-m", "kvflow_vllm.engine_process", str(spec), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            timeout=timeout,
        ).returncode
    if rc != 0:
        raise EngineFailed(name, rc, log.read_text(errors="replace"))
    return msgspec.json.decode(out.read_bytes(), type=ScenarioResult)


class ServeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """One line on a serving engine's stdin."""

    prompt: list[int]
    max_tokens: int = 8
    kv_transfer_params: dict[str, Any] | None = None
    sampling: Sampling | None = None


def serve(sc: Scenario) -> None:
    """Answer `ServeRequest` JSON lines on stdin with `GenResult` lines on stdout, until EOF.

    A long-running engine for tests that need two live engines at once
    (prefill/decode): the caller plays the proxy. Prints `READY` once started.
    """
    llm = _start(sc)
    out = sys.__stdout__
    assert out is not None
    out.write("READY\n")
    out.flush()
    for line in _lines_between_steps(llm):
        if not line.strip():
            continue
        req = msgspec.json.decode(line, type=ServeRequest)
        (res,) = generate(llm, [req.prompt], req.max_tokens, req.kv_transfer_params, req.sampling)
        out.write(msgspec.json.encode(res).decode() + "\n")
        out.flush()
    llm.llm_engine.engine_core.shutdown()  # held requests end with it, as in vLLM


def _in_process_core(llm: Any) -> Any:
    """vLLM's engine core where it runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`:
    `InprocClient`'s), else None."""
    return getattr(llm.llm_engine.engine_core, "engine_core", None)


def _lines_between_steps(llm: Any) -> Iterator[str]:
    """stdin's lines, as they come. Between them an engine core in this process steps
    while its scheduler has requests (held and finished ones too), as vLLM's engine core
    process does in its busy loop: a producer's held requests, their pulls' completion
    and their hold timeouts need steps, which `generate()` makes for its own requests
    only. Each idle step first waits up to 1 ms for a line, leaving the GIL to kvflow's
    threads."""
    import select

    core = _in_process_core(llm)
    fd = sys.stdin.fileno()
    pending = b""
    while True:
        if b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            yield line.decode()
            continue
        held = core is not None and core.scheduler.has_requests()
        if held and not select.select([fd], [], [], 0.001)[0]:
            llm.llm_engine.step()
        elif chunk := os.read(fd, 1 << 16):
            pending += chunk
        else:  # EOF
            if pending:
                yield pending.decode()
            return


def _shutdown(llm: Any) -> None:
    """End the engine: an engine core in this process first steps until its scheduler
    holds no request (a connector's saves and exports report their end in steps), as
    vLLM's engine core process keeps stepping after `generate()` returns; then the
    connectors drain what is in flight."""
    core = _in_process_core(llm)
    while core is not None and core.scheduler.has_requests():
        llm.llm_engine.step()
    llm.llm_engine.engine_core.shutdown()


def main(argv: list[str]) -> int:
    """`python -m kvflow_vllm.engine_process SCENARIO.json RESULT.json`: one engine process.
    `python -m kvflow_vllm.engine_process --serve SCENARIO.json`: serve requests on stdin."""
    if argv[0] == "--serve":
        with open(argv[1], "rb") as f:
            serve(msgspec.json.decode(f.read(), type=Scenario))
        return 0
    with open(argv[0], "rb") as f:
        sc = msgspec.json.decode(f.read(), type=Scenario)
    res = run_scenario(sc)
    with open(argv[1], "wb") as f:
        f.write(msgspec.json.encode(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
