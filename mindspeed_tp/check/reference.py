"""Reference logprobs saved to / loaded from safetensors (no pickle), with what they were made of."""
import os
from typing import Dict

import torch
from safetensors.torch import load_file, save_file
from safetensors import safe_open

from ..errors import ConfigError


def save_reference(path: str, tensors: Dict[str, torch.Tensor], meta: Dict[str, str]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
    os.replace(tmp, path)


def reference_metadata(path: str) -> Dict[str, str]:
    """A reference file's metadata, refused by name unless it is a readable safetensors file (the
    launcher checks it before starting any worker, the workers again when they load it)."""
    if not path.endswith(".safetensors"):
        raise ConfigError(f"--reference {path!r}: reference files are safetensors (*.safetensors)")
    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types
        raise ConfigError(f"--reference {path!r} cannot be read as safetensors: {exc}") from exc


def load_reference(path: str, expected_meta: Dict[str, str]) -> Dict[str, torch.Tensor]:
    """Load a reference file and refuse it, naming the field, if it was made for other inputs."""
    meta = reference_metadata(path)
    for key, value in expected_meta.items():
        if meta.get(key) != value:
            raise ConfigError(
                f"--reference {path!r} was made with {key}={meta.get(key)!r}, this run has {key}={value!r}; "
                f"recompute it (omit --reference) or match {key}"
            )
    return load_file(path)
