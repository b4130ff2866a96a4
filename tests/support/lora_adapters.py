"""LoRA adapters for the tiny test model, in PEFT's format (what vLLM loads): seeded,
so an adapter's bytes are the same wherever it is written, and strong enough that two
adapters give a prompt different KV and different tokens."""

from __future__ import annotations

import json
from pathlib import Path

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj")
"""Projections that make KV: an adapter on them changes the KV cache itself."""


def write_adapter(out: Path, seed: int, model: str) -> str:
    """A rank-`RANK` adapter on `TARGETS` of every layer of the model at `model`, under
    `out`; its path."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model) / "config.json").read_text())
    h, hd = config["hidden_size"], config["head_dim"]
    outs = {
        "q_proj": config["num_attention_heads"] * hd,
        "k_proj": config["num_key_value_heads"] * hd,
        "v_proj": config["num_key_value_heads"] * hd,
    }
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(config["num_hidden_layers"]):
        for t in TARGETS:
            p = f"base_model.model.model.layers.{i}.self_attn.{t}"
            weights[f"{p}.lora_A.weight"] = torch.randn(RANK, h, generator=g) * 0.1
            weights[f"{p}.lora_B.weight"] = torch.randn(outs[t], RANK, generator=g) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": RANK,
                "lora_alpha": 2 * RANK,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": list(TARGETS),
                "base_model_name_or_path": model,
            }
        )
    )
    return str(out)
