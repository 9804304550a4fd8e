"""Llama 2 / 3 / 3.1 / 3.2 / 3.3: transformers' llama, vLLM's llama.py. No QK-norm, no biases
(``attention_bias`` would also put one on o_proj, ``mlp_bias`` on the MLP: refused), plain or
Llama-3-scaled RoPE (rope_type ``llama3`` with Megatron's fixed low / high factors and original
context), tied embeddings in Llama-3.2 1B / 3B."""
from __future__ import annotations

from typing import Any, Dict

from ..contract.refusals import refuse
from .common import (check_exportable, check_model_type, decoder_config, decoder_fields, refuse_sliding_window,
                     rope_fields)

NAME = "llama"
ARCHITECTURES = {"LlamaForCausalLM": "llama"}
FIXED = dict(qk_layernorm=False, add_qkv_bias=False)  # what the architecture fixes (import sets, export checks)


def spec_fields(cfg: Dict[str, Any], architecture: str, name: str, where: str) -> Dict[str, Any]:
    check_model_type(cfg, "llama", architecture, where)
    if cfg.get("attention_bias"):
        raise refuse("hf_attention_bias", where=where, family="Llama")
    if cfg.get("mlp_bias"):
        raise refuse("hf_mlp_bias", where=where)
    if int(cfg.get("pretraining_tp", 1) or 1) != 1:
        raise refuse("hf_pretraining_tp", where=where, tp=cfg.get("pretraining_tp"))
    refuse_sliding_window(cfg, where)
    return dict(decoder_fields(cfg, name, where), **rope_fields(cfg, where, scalings=("llama3",)), family=NAME,
                **FIXED)


def hf_config(spec, dtype: str) -> Dict[str, Any]:
    check_exportable(spec, "Llama", FIXED, allows=("rope_scaling_factor",))
    cfg = decoder_config(spec, "LlamaForCausalLM", "llama", dtype)
    cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    return cfg
