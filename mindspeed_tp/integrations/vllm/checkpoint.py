"""Weights for the engine: a bundled model written as a Hugging Face checkpoint (what vLLM loads),
and a training model's weights gathered to Hugging Face names for an in-memory weight sync."""
from __future__ import annotations

import json
import os
from typing import Dict, Iterator, Tuple

import torch
from safetensors.torch import save_file

from ...hf.config import hf_config_from_spec
from ...hf.export import megatron_to_hf
from ...models.spec import ModelSpec
from ...models.weights import full_weights

_HF_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def write_hf_checkpoint(spec: ModelSpec, source, padded_vocab: int, dtype: torch.dtype, out_dir: str) -> str:
    """``source``'s weights (e.g. SeededWeights) as ``out_dir/model.safetensors`` + ``config.json``,
    the same bits the training side loads (mapped by ``hf.export.megatron_to_hf``)."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = megatron_to_hf(full_weights(spec, padded_vocab, source, dtype), spec, padded_vocab)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_from_spec(spec, _HF_DTYPES[dtype]), f, indent=1)
    return out_dir


def hf_tensors_from_full(full: Dict[str, torch.Tensor], spec: ModelSpec, padded_vocab: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """Megatron TP=1 tensors -> (HF name, tensor) pairs, what the engine's ``load_weights`` takes."""
    return iter(megatron_to_hf(full, spec, padded_vocab).items())
