"""Qwen2 / Qwen2.5 and their distillations (DeepSeek-R1-Distill-Qwen): transformers' qwen2, vLLM's
qwen2.py. A bias on q, k and v (always: Qwen2's attention has no switch for it), no QK-norm, plain
RoPE, tied embeddings at the small sizes, the head size hidden / heads (vLLM's qwen2.py ignores a
``head_dim`` key). Sliding windows (``use_sliding_window``, off in every released checkpoint) are
refused."""
from __future__ import annotations

from typing import Any, Dict

from ..errors import ConfigError
from .common import (check_exportable, check_model_type, decoder_config, decoder_fields, refuse_sliding_window,
                     rope_fields)

NAME = "qwen2"
ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2"}
FIXED = dict(qk_layernorm=False, add_qkv_bias=True)  # what the architecture fixes (import sets, export checks)


def spec_fields(cfg: Dict[str, Any], architecture: str, name: str, where: str) -> Dict[str, Any]:
    check_model_type(cfg, "qwen2", architecture, where)
    refuse_sliding_window(cfg, where)
    derived = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    if int(cfg.get("head_dim") or derived) != derived:
        raise ConfigError(f"{where}: head_dim={cfg['head_dim']} differs from hidden_size / num_attention_heads = "
                          f"{derived}, which Qwen2 (vLLM's qwen2.py) uses; remove head_dim or fix it")
    return dict(decoder_fields(cfg, name, where), **rope_fields(cfg, where, scalings=("yarn",)), family=NAME, **FIXED)


def hf_config(spec, dtype: str) -> Dict[str, Any]:
    if spec.kv_channels * spec.num_attention_heads != spec.hidden_size:
        raise ConfigError(f"model {spec.name}: kv_channels={spec.kv_channels} is not hidden_size / num_attention_heads "
                          f"= {spec.hidden_size // spec.num_attention_heads}, the head size a Qwen2 checkpoint implies")
    check_exportable(spec, "Qwen2", FIXED, allows=("yarn",))
    cfg = decoder_config(spec, "Qwen2ForCausalLM", "qwen2", dtype)
    cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_layers)
    return cfg
