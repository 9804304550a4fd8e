"""Model families, one module each (as vLLM and transformers keep one file per architecture): the
Hugging Face ``config.json`` it reads and writes, and the ModelSpec fields it sets. What a family's
layers compute differently is a spec field each (``qk_layernorm``, ``add_qkv_bias``,
``rope_scaling_factor``, ``rotary_percent``, ``sliding_window``, the router's fields, ...) that the
shared pieces honour: the tensor map (``hf/mapping.py``), the Megatron build (``check/builder.py``),
the reference engine and the profiles' forwards.

A family module defines ``NAME`` (``ModelSpec.family``), ``ARCHITECTURES`` (config.json's
``architectures`` entries it reads), ``FIXED`` (the spec fields its architecture fixes: set on import,
checked on export), ``spec_fields(cfg, architecture, name, where)`` and ``hf_config(spec, dtype)``;
with MoE layers also ``EXPERT_NAMES`` (where its checkpoints keep them; ``STACKED_EXPERTS`` where they
are stacked tensors, ``hf/stacked.py``), and ``MTP_LAYERS_KEY`` where
its checkpoints carry multi-token-prediction layers (dropped at import). Adding a family is one module
listed here (docs/DEVELOPING.md)."""
from __future__ import annotations

from types import ModuleType
from typing import Dict

from . import deepseek_v3, glm4_moe, gpt_oss, llama, mistral, mixtral, qwen2, qwen3

FAMILIES: Dict[str, ModuleType] = {m.NAME: m for m in (qwen3, qwen2, llama, mistral, mixtral, glm4_moe, deepseek_v3,
                                                       gpt_oss)}
BY_ARCHITECTURE: Dict[str, ModuleType] = {arch: m for m in FAMILIES.values() for arch in m.ARCHITECTURES}


def supported_architectures():
    return sorted(BY_ARCHITECTURE)
