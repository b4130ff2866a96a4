"""A tiny EAGLE (or EAGLE3) draft head for a Llama target, with seeded random weights: its
drafts are rarely accepted, and the target's tokens are the same as without it.

Layout follows vLLM 0.32's loaders:
- EAGLE-1: vllm/model_executor/models/llama_eagle.py (EagleLlamaForCausalLM).
  Checkpoint names carry no "model." prefix (load_weights adds it). Layer 0 has no
  input_layernorm (replaced by Identity), there is no final norm, and fc maps
  cat(embed, target_hidden) [2h] -> h. embed_tokens / lm_head are omitted, so
  vLLM shares the target's (v1/spec_decode/llm_base_proposer.py
  _maybe_share_embeddings / _maybe_share_lm_head).
- EAGLE3: vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM).
  fc maps 3 aux hidden states [3h] -> h; layer 0's qkv takes 2h (cat(embed, hidden));
  extra hidden_norm and a final norm. lm_head/embed_tokens omitted (shared).
"""

from __future__ import annotations

import json
from pathlib import Path


def write_eagle_head(
    out_dir: Path, target_model_dir: str, seed: int = 0, method: str = "eagle"
) -> str:
    """Write config.json + model.safetensors for a 1-layer draft head; return the dir."""
    import torch
    from safetensors.torch import save_file

    if method not in ("eagle", "eagle3"):
        raise ValueError(f"method must be 'eagle' or 'eagle3', not {method!r}")
    target = json.loads((Path(target_model_dir) / "config.json").read_text())
    h, inter = target["hidden_size"], target["intermediate_size"]
    hd = target.get("head_dim") or h // target["num_attention_heads"]
    q = target["num_attention_heads"] * hd
    kv = target["num_key_value_heads"] * hd

    config = dict(target)
    config["num_hidden_layers"] = 1
    config["architectures"] = (
        ["EagleLlamaForCausalLM"] if method == "eagle" else ["Eagle3LlamaForCausalLM"]
    )
    config["model_type"] = "llama"
    if method == "eagle3":
        config["target_hidden_size"] = h
        config["draft_vocab_size"] = target["vocab_size"]  # no d2t mapping needed

    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    qkv_in = h if method == "eagle" else 2 * h
    p = "layers.0."
    w: dict[str, torch.Tensor] = {
        "fc.weight": rand(h, 2 * h if method == "eagle" else 3 * h),
        p + "self_attn.q_proj.weight": rand(q, qkv_in),
        p + "self_attn.k_proj.weight": rand(kv, qkv_in),
        p + "self_attn.v_proj.weight": rand(kv, qkv_in),
        p + "self_attn.o_proj.weight": rand(h, q),
        p + "mlp.gate_proj.weight": rand(inter, h),
        p + "mlp.up_proj.weight": rand(inter, h),
        p + "mlp.down_proj.weight": rand(h, inter),
        p + "post_attention_layernorm.weight": torch.ones(h),
    }
    if method == "eagle3":
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "hidden_norm.weight"] = torch.ones(h)
        w["norm.weight"] = torch.ones(h)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return str(out)
