"""Read-only access to a Hugging Face safetensors checkpoint (one file or an index of shards).

Tensors are read by slice (``safe_open(...).get_slice``), so a rank reads only the rows or
columns its shard needs. Pickle-based files (``*.bin``, ``*.pt``) are refused, never loaded.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Dict, List, Optional, Tuple

import torch
from safetensors import safe_open

from ..errors import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class SafetensorsCheckpoint:
    def __init__(self, directory: str):
        self.directory = directory
        if not os.path.isdir(directory):
            raise ConfigError(f"--hf-checkpoint {directory!r} is not a directory")
        index_path, single_path = os.path.join(directory, INDEX), os.path.join(directory, SINGLE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError) as exc:
                    raise ConfigError(f"{index_path}: not a safetensors index (needs a 'weight_map')") from exc
        elif os.path.isfile(single_path):
            weight_map = None
        else:
            pickled = sorted(p for p in os.listdir(directory) if p.endswith(_PICKLE_SUFFIXES))
            found = f" (found {pickled}: pickle-based files are never loaded)" if pickled else ""
            raise ConfigError(
                f"--hf-checkpoint {directory!r}: no {SINGLE} or {INDEX}{found}; convert the checkpoint to "
                f"safetensors, e.g. model.save_pretrained(dir, safe_serialization=True)"
            )
        self._handles = {}
        self.files: List[str] = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        for name in self.files:
            if not os.path.isfile(os.path.join(directory, name)):
                raise ConfigError(f"{index_path}: lists {name}, which is missing from {directory}")
        if weight_map is None:
            weight_map = {k: SINGLE for k in self._open(SINGLE).keys()}
        self.weight_map: Dict[str, str] = dict(weight_map)

    def _open(self, file: str):
        if file not in self._handles:
            path = os.path.join(self.directory, file)
            try:
                self._handles[file] = safe_open(path, framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise ConfigError(f"{path} cannot be read as safetensors: {exc}") from exc
        return self._handles[file]

    def names(self) -> List[str]:
        return sorted(self.weight_map)

    def _slice(self, name: str):
        handle = self._open(self.weight_map[name])
        if name not in handle.keys():
            raise ConfigError(f"{self.directory}: the index maps {name} to {self.weight_map[name]}, which lacks it")
        return handle.get_slice(name)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rows: Optional[Tuple[int, int]] = None,
             cols: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """The tensor, or rows [a, b) (and columns [c, d)) of it, reading only those bytes."""
        part = self._slice(name)
        if rows is None and cols is None:
            return part[:]
        r = slice(*rows) if rows is not None else slice(None)
        return part[r] if cols is None else part[r, slice(*cols)]

    @functools.cached_property
    def digest(self) -> str:
        """Identifies the checkpoint (computed once) without reading it all: every file's size, its safetensors
        header (names, dtypes, shapes, offsets) and its first and last 64 KiB of data."""
        h = hashlib.sha256()
        for file in self.files:
            path = os.path.join(self.directory, file)
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                h.update(file.encode() + str(size).encode() + f.read(header_len) + f.read(65536))
                f.seek(max(8 + header_len, size - 65536))
                h.update(f.read())
        return h.hexdigest()[:16]
