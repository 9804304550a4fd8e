"""Weight source for Megatron models and the reference model: a Hugging Face checkpoint."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import ConfigError
from ..models.spec import ModelSpec
from .checkpoint import SafetensorsCheckpoint
from .config import read_hf_config, spec_from_hf_config
from .mapping import Piece, expected_hf_shapes, megatron_pieces
from .stacked import per_expert_view

# Buffers some exporters save that are recomputed from the config, never weights.
_DERIVED = (".rotary_emb.inv_freq",)


def _mtp_layer_tensors(names, spec: ModelSpec, directory: str) -> List[str]:
    """The tensors of the multi-token-prediction layers config.json declares (the family's
    MTP_LAYERS_KEY), which its checkpoints keep right after the ``num_layers`` decoder layers: not part
    of the next-token model. Any other extra layer stays unexpected."""
    from ..families import FAMILIES

    key = getattr(FAMILIES[spec.family], "MTP_LAYERS_KEY", None)
    declared = int(read_hf_config(directory).get(key) or 0) if key else 0
    mtp = range(spec.num_layers, spec.num_layers + declared)
    return sorted(n for n in names if n.startswith("model.layers.")
                  and n.split(".")[2].isdigit() and int(n.split(".")[2]) in mtp)


def validate_tensors(checkpoint: SafetensorsCheckpoint, spec: ModelSpec) -> None:
    """Every expected tensor present with its shape, nothing unexpected; names the first problems.
    A family's multi-token-prediction layers are dropped, with a note."""
    want = expected_hf_shapes(spec)
    have = {n for n in checkpoint.names() if not n.endswith(_DERIVED)}
    mtp = _mtp_layer_tensors(have, spec, checkpoint.directory)
    if mtp:
        have -= set(mtp)
        layers = sorted({int(n.split(".")[2]) for n in mtp})
        _note(f"{checkpoint.directory}: the multi-token-prediction layer(s) {layers} ({len(mtp)} tensors) are not "
              f"loaded: the checkers score and train the next-token model (megatron's mtp_num_layers is refused)")
    missing, unexpected = sorted(set(want) - have), sorted(have - set(want))
    where = checkpoint.directory
    if missing:
        raise ConfigError(f"{where}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                          f"({len(missing)} in all) for a {spec.num_layers}-layer model as config.json describes")
    if unexpected:
        raise ConfigError(f"{where}: unexpected tensor(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
                          f"({len(unexpected)} in all): not part of the architecture in config.json")
    for name, shape in want.items():
        found = checkpoint.shape(name)
        if found != shape:
            raise ConfigError(f"{where}: tensor {name} has shape {list(found)}, config.json implies {list(shape)}")


def _note(message: str) -> None:
    """Printed once per job: by rank 0 of a launched world, or by a process without one."""
    import sys

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"note: {message}", file=sys.stderr)


class HFWeights:
    """Serves Megatron TP=1 tensors, or any shard of them, read by slice from the checkpoint."""

    def __init__(self, checkpoint: SafetensorsCheckpoint, spec: ModelSpec, padded_vocab: int):
        validate_tensors(checkpoint, spec)
        self.checkpoint, self.spec = checkpoint, spec
        self.pieces: Dict[str, List[Piece]] = megatron_pieces(spec, padded_vocab)

    def _read(self, name: str, rows: List[Tuple[int, int]], cols: Optional[Tuple[int, int]]) -> torch.Tensor:
        """Row ranges ``rows`` (of the Megatron tensor, concatenated in that order) and columns
        ``cols`` of Megatron tensor ``name``, reading only those bytes of the checkpoint."""
        pieces = self.pieces[name]
        first = next(p.hf_name for p in pieces if p.hf_name)
        parts = []
        for lo, hi in rows:
            offset = 0
            for piece in pieces:
                a, b = max(lo, offset), min(hi, offset + piece.rows)
                if a < b:
                    if piece.hf_name is None:  # vocabulary padding
                        like = self.checkpoint.read(first, (0, 1), cols)
                        parts.append(torch.zeros((b - a,) + tuple(like.shape[1:]), dtype=like.dtype))
                    else:
                        start = piece.start + a - offset
                        parts.append(self.checkpoint.read(piece.hf_name, (start, start + b - a), cols))
                offset += piece.rows
        return torch.cat(parts, dim=0)

    def _rows(self, name: str) -> int:
        return sum(p.rows for p in self.pieces[name])

    def _check(self, name: str, full_shape: Tuple[int, ...]) -> None:
        if name not in self.pieces:
            raise ConfigError(f"the model has parameter {name}, which the Hugging Face mapping (hf/mapping.py) does not know")
        if full_shape[0] != self._rows(name):
            raise ConfigError(f"parameter {name}: the model expects {full_shape[0]} rows, the checkpoint gives "
                              f"{self._rows(name)}")

    def full(self, name: str, shape: Tuple[int, ...]) -> torch.Tensor:
        self._check(name, shape)
        return self._read(name, [(0, shape[0])], None)

    def shard(self, name: str, rule: str, full_shape: Tuple[int, ...], size: int, rank: int) -> torch.Tensor:
        self._check(name, full_shape)
        n = full_shape[0]
        if rule == "column":
            return self._read(name, [(rank * n // size, (rank + 1) * n // size)], None)
        if rule == "column_gated":
            half, step = n // 2, n // 2 // size
            return self._read(name, [(rank * step, (rank + 1) * step), (half + rank * step, half + (rank + 1) * step)],
                              None)
        if rule == "row":
            step = full_shape[1] // size
            return self._read(name, [(0, n)], (rank * step, (rank + 1) * step))
        return self._read(name, [(0, n)], None)

    def describe(self) -> Dict[str, object]:
        return {"kind": "hf", "checkpoint": self.checkpoint.digest}

    def digest(self, profile) -> str:
        return self.checkpoint.digest


def open_hf_model(directory: str, profile) -> Tuple[ModelSpec, HFWeights]:
    """(ModelSpec from config.json, weight source) for a checkpoint directory of a supported family (``mindspeed_tp.families``)."""
    cfg = read_hf_config(directory)
    name = os.path.basename(os.path.normpath(directory))
    try:
        spec = spec_from_hf_config(cfg, name, os.path.join(directory, "config.json"))
    except KeyError as exc:
        raise ConfigError(f"{os.path.join(directory, 'config.json')}: missing field {exc.args[0]!r}") from exc
    return spec, HFWeights(per_expert_view(SafetensorsCheckpoint(directory), spec), spec, spec.padded_vocab(profile))
