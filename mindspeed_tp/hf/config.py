"""ModelSpec from a Hugging Face ``config.json``, and back, by the architecture's family module
(``mindspeed_tp.families``)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict

from ..contract.refusals import refuse
from ..errors import ConfigError
from ..models.spec import ModelSpec


def read_hf_config(directory: str) -> Dict[str, Any]:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--hf-checkpoint {directory!r}: no config.json (expected a Hugging Face model directory)")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc


def spec_from_hf_config(cfg: Dict[str, Any], name: str, where: str = "config.json") -> ModelSpec:
    from ..families import BY_ARCHITECTURE, supported_architectures

    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in BY_ARCHITECTURE:
        raise refuse("hf_architecture", where=where, archs=archs, supported=supported_architectures())
    return ModelSpec(**BY_ARCHITECTURE[archs[0]].spec_fields(cfg, archs[0], name, where))


def hf_config_from_spec(spec: ModelSpec, dtype: str = "bfloat16") -> Dict[str, Any]:
    """A config.json for exporting a model defined by a ModelSpec (inverse of spec_from_hf_config)."""
    from ..families import FAMILIES

    return FAMILIES[spec.family].hf_config(spec, dtype)
