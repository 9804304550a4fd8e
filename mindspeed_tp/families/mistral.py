"""Mistral 7B (v0.1 with its 4096-token sliding window; v0.2 / v0.3 without) and Mistral-Nemo (head
size 128, not hidden / heads): transformers' mistral, vLLM's mistral.py (its Llama model). No QK-norm,
no biases, plain RoPE, untied head; a ``sliding_window`` W windows every layer (each query sees
itself and the W - 1 keys before it). Alternating window layers (``layer_types``: Ministral, Gemma)
are refused."""
from __future__ import annotations

from typing import Any, Dict

from ..contract.refusals import refuse
from .common import (check_exportable, check_model_type, decoder_config, decoder_fields, refuse_sliding_window,
                     rope_fields)

NAME = "mistral"
ARCHITECTURES = {"MistralForCausalLM": "mistral"}
FIXED = dict(qk_layernorm=False, add_qkv_bias=False)  # what the architecture fixes (import sets, export checks)


def spec_fields(cfg: Dict[str, Any], architecture: str, name: str, where: str) -> Dict[str, Any]:
    check_model_type(cfg, "mistral", architecture, where)
    if cfg.get("attention_bias"):
        raise refuse("hf_attention_bias", where=where, family="Mistral")
    refuse_sliding_window(cfg, where, every_layer=True)
    window = cfg.get("sliding_window")
    return dict(decoder_fields(cfg, name, where), **rope_fields(cfg, where), family=NAME, **FIXED,
                sliding_window=None if window is None else int(window))


def hf_config(spec, dtype: str) -> Dict[str, Any]:
    check_exportable(spec, "Mistral", FIXED, allows=("sliding_window",))
    cfg = decoder_config(spec, "MistralForCausalLM", "mistral", dtype)
    cfg.update(sliding_window=spec.sliding_window)
    return cfg
