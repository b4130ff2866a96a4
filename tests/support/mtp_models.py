"""A tiny MiMo model (vLLM's `MiMoForCausalLM`, Qwen2 layers) with one MTP layer, for
MTP speculative decoding (`speculative_config={"method": "mtp", ...}`) on vLLM's CPU build.

Layout follows vLLM 0.32's loaders (vllm/model_executor/models/mimo.py, mimo_mtp.py): the
base model's names as Qwen2's (q/k/v projections with biases); the MTP layer under
`model.mtp_layers.0.` (its norms, `input_proj` over cat(hidden, embedding), a Qwen2 block
written flat: vLLM's loader moves it to `mtp_block`); no embedding or lm_head of its own
(vLLM shares the target's). `model_type` is `qwen2`: transformers knows no `mimo`, and
vLLM picks the MTP model from `architectures`.

Seeded weights shaped so that drafts are accepted (the MTP layer's KV then matters): the
embeddings dominate the residual stream (std 1), the attention and MLP outputs are small
(std 0.01), and `input_proj` passes the next token's embedding through; target and draft
are both near-bigram models perturbed by attention over the KV.
"""

from __future__ import annotations

import json
from pathlib import Path

H, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 256, 4, 4, 2, 64, 512, 1024


def write_mimo(out_dir: Path, seed: int = 0) -> str:
    """Write config.json + model.safetensors; return the dir."""
    import torch
    from safetensors.torch import save_file

    config = {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": H,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTER,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
    }
    g = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {}

    def rand(name: str, *shape: int, std: float = 0.05) -> None:
        w[name] = torch.randn(*shape, generator=g) * std

    def block(p: str) -> None:
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            rand(f"{p}self_attn.{proj}_proj.weight", rows, H)
            rand(f"{p}self_attn.{proj}_proj.bias", rows)
        rand(f"{p}self_attn.o_proj.weight", H, q, std=0.01)
        rand(f"{p}mlp.gate_proj.weight", INTER, H)
        rand(f"{p}mlp.up_proj.weight", INTER, H)
        rand(f"{p}mlp.down_proj.weight", H, INTER, std=0.01)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[f"{p}{norm}.weight"] = torch.ones(H)

    rand("model.embed_tokens.weight", VOCAB, H, std=1.0)
    for i in range(LAYERS):
        block(f"model.layers.{i}.")
    w["model.norm.weight"] = torch.ones(H)
    rand("lm_head.weight", VOCAB, H)
    mtp = "model.mtp_layers.0."
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        w[f"{mtp}{norm}.weight"] = torch.ones(H)
    w[f"{mtp}input_proj.weight"] = torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1)
    block(mtp)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in w.items()}, str(out_dir / "model.safetensors"))
    return str(out_dir)
