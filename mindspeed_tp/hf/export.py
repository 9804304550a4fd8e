"""Export a Megatron model in any layout to a Hugging Face safetensors checkpoint.

Each rank writes its shards (with their shard rule and rank) to a safetensors part file in the
output directory; rank 0 reassembles the TP=1 tensors, maps them to Hugging Face names and writes
``model.safetensors`` (or numbered shards plus ``model.safetensors.index.json``) and
``config.json``. The output directory must be visible to every rank (a shared filesystem when
the ranks span nodes). Part files are read with safetensors, never pickle, and removed afterwards.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import ConfigError
from ..models.spec import ModelSpec
from ..models.weights import full_weight_shapes, global_param_name, is_expert_weight, shard_rule, unshard
from .checkpoint import INDEX, SINGLE
from .config import hf_config_from_spec
from .mapping import expected_hf_shapes, megatron_pieces
from .stacked import in_family_layout

PARTS = ".mindspeed-tp-export-parts"
# Files next to the weights that describe the model or its tokenizer, copied from the source.
_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def _local_shards(model, spec: ModelSpec, layout):
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank() if spec.is_moe else 0
    tp_rank = ps.get_tensor_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank() if spec.is_moe else 0
    tensors, info = {}, {}
    for local_name, param in model.named_parameters():
        name = global_param_name(model, local_name, ep_rank)
        size, rank = (layout.etp, etp_rank) if is_expert_weight(name) else (layout.tp, tp_rank)
        tensors[name] = param.detach().contiguous()
        info[name] = [shard_rule(name), size, rank]
    for local_name, buf in model.named_buffers():  # the routers' expert biases (replicated, fp32)
        if local_name.endswith("router.expert_bias"):
            name = global_param_name(model, local_name, ep_rank)
            tensors[name], info[name] = buf.detach().contiguous(), ["replicated", 1, 0]
    return tensors, info


def _assemble(parts_dir: str, world: int, spec: ModelSpec, padded_vocab: int) -> Dict[str, torch.Tensor]:
    """Megatron TP=1 tensors from every rank's part file (replicas are identical; one is kept)."""
    shards: Dict[str, Dict[int, torch.Tensor]] = {}
    rules: Dict[str, List] = {}
    for r in range(world):
        with safe_open(os.path.join(parts_dir, f"rank{r}.safetensors"), framework="pt") as f:
            for name, (rule, size, rank) in json.loads(f.metadata()["shards"]).items():
                if rank not in shards.setdefault(name, {}):  # replicas are identical; keep one
                    shards[name][rank] = f.get_tensor(name)
                rules[name] = [rule, size]
    full = {}
    for name, shape in full_weight_shapes(spec, padded_vocab).items():
        if name not in shards:
            raise ConfigError(f"export: no rank holds {name}; was the model built for this spec?")
        rule, size = rules[name]
        if sorted(shards[name]) != list(range(size)):
            raise ConfigError(f"export: {name} has shards {sorted(shards[name])} of {size}")
        full[name] = unshard([shards[name][i] for i in range(size)], rule)
        if tuple(full[name].shape) != shape:
            raise ConfigError(f"export: {name} reassembled to {list(full[name].shape)}, expected {list(shape)}")
    return full


def megatron_to_hf(full: Dict[str, torch.Tensor], spec: ModelSpec, padded_vocab: int) -> Dict[str, torch.Tensor]:
    """Hugging Face tensors from Megatron TP=1 tensors (vocabulary padding dropped; a family's stacked
    experts stacked: ``hf/stacked.py``)."""
    shapes = expected_hf_shapes(spec)
    out: Dict[str, torch.Tensor] = {}  # each in its Megatron tensor's dtype (the expert bias stays fp32)
    filled = {name: 0 for name in shapes}
    for name, pieces in megatron_pieces(spec, padded_vocab).items():
        if name not in full:
            continue  # the tied output layer's copy
        offset = 0
        for piece in pieces:
            if piece.hf_name is not None:
                if piece.hf_name not in out:
                    out[piece.hf_name] = torch.empty(shapes[piece.hf_name], dtype=full[name].dtype)
                out[piece.hf_name][piece.start:piece.stop] = full[name][offset:offset + piece.rows]
                filled[piece.hf_name] += piece.rows
            offset += piece.rows
    for name, shape in shapes.items():
        assert filled[name] == shape[0], f"export mapping covers {filled[name]} of {shape[0]} rows of {name}"
    return in_family_layout(out, spec)


def _save_hf(tensors: Dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int) -> None:
    files, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            files.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    files.append(current)
    names = [SINGLE] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                             for i in range(len(files))]
    for file, part in zip(names, files):
        tmp = os.path.join(out_dir, file + ".tmp")
        save_file(part, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(out_dir, file))
    if len(files) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: file for file, part in zip(names, files) for n in part}}
        _write_json(os.path.join(out_dir, INDEX), index)


def _write_json(path: str, data) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2)
    os.replace(path + ".tmp", path)


def export_hf_checkpoint(model, spec: ModelSpec, layout, padded_vocab: int, out_dir: str,
                         hf_config: Optional[dict] = None, copy_from: Optional[str] = None,
                         max_shard_bytes: int = 5 * 1024 ** 3) -> None:
    """Collective over the default group: every rank passes its stage of the model.

    hf_config: the config.json to write (default: derived from ``spec``); copy_from: a source
    checkpoint directory whose tokenizer / generation files are copied along.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    parts_dir = os.path.join(out_dir, PARTS)
    if rank == 0:
        os.makedirs(parts_dir, exist_ok=True)
    dist.barrier()
    tensors, info = _local_shards(model, spec, layout)
    save_file(tensors, os.path.join(parts_dir, f"rank{rank}.safetensors"), metadata={"shards": json.dumps(info)})
    dist.barrier()
    error = None
    if rank == 0:
        try:
            full = _assemble(parts_dir, world, spec, padded_vocab)
            _save_hf(megatron_to_hf(full, spec, padded_vocab), out_dir, max_shard_bytes)
            cfg = dict(hf_config) if hf_config is not None else hf_config_from_spec(spec)
            _write_json(os.path.join(out_dir, "config.json"), cfg)
            for side in _SIDE_FILES if copy_from else ():
                if os.path.isfile(os.path.join(copy_from, side)):
                    shutil.copyfile(os.path.join(copy_from, side), os.path.join(out_dir, side))
        except ConfigError as exc:
            error = str(exc)
        finally:
            shutil.rmtree(parts_dir, ignore_errors=True)
    flag = torch.tensor([1 if error else 0])
    dist.broadcast(flag, src=0)  # every rank fails together, none waits forever
    if flag.item():
        raise ConfigError(error or "export failed on rank 0 (see its error)")
