"""``--transformer-config FILE.yaml``: the user's TransformerConfig fields (as verl's
``override_transformer_config`` or Megatron-LM's arguments give them) applied over the config the
checkers build for the bundled model (check/builder.py), so a user checks the config they train with.
The file is checked before anything is launched by the same function a user's GPTModel construction
runs (contract/model_config.py): a field the contract cannot keep exits 2 naming it."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Optional

import yaml

from ..contract.config_fields import FROM_CHECKER, config_classes
from ..errors import ConfigError

# Fields that hold callables or objects a YAML file cannot give.
_OBJECTS = ("activation_func", "init_method", "output_layer_init_method", "embedding_init_method", "timers",
            "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
            "moe_grad_scale_func", "mtp_grad_scale_func", "_cpu_offloading_context", "fp8_quantizer_factory",
            "fp4_quantizer_factory", "experimental_attention_variant_loss_scale_func")
_FLAG_OF = {"tensor_model_parallel_size": "--tp (check) or --layouts tpN (train-check, rl-check)",
            "pipeline_model_parallel_size": "--pp (check) or --layouts ppN (train-check, rl-check)",
            "virtual_pipeline_model_parallel_size": "--layouts (vppN)",
            "sequence_parallel": "--sp (check) or --layouts ...-sp (train-check, rl-check)",
            "context_parallel_size": "--cp (check) or --layouts cpN (train-check, rl-check)",
            "expert_model_parallel_size": "--ep (check) or --layouts epN (train-check, rl-check)",
            "expert_tensor_parallel_size": "--etp (check) or --layouts etpN (train-check, rl-check)",
            "params_dtype": "--dtype", "pipeline_dtype": "--dtype", "bf16": "--dtype",
            "moe_token_dispatcher_type": "--dispatcher", "recompute_granularity": "--recompute",
            "recompute_method": "--recompute", "recompute_num_layers": "--recompute",
            "recompute_modules": "--recompute",
            # not a flag: the training checkers' loss is the per-token sum over all tokens (a per-rank mean,
            # megatron's default, weighs tokens by how CP / DP split them: the objective depends on the layout)
            "calculate_per_token_loss": "the training checkers, which always train with the per-token loss (a "
                                        "per-rank mean would depend on the CP and DP sizes); no setting changes it"}


def load(path: Optional[str]) -> Dict[str, Any]:
    """The fields of ``path`` (empty without one): a YAML mapping of TransformerConfig field names."""
    if not path:
        return {}
    if not os.path.isfile(path):
        raise ConfigError(f"--transformer-config {path}: no such file")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--transformer-config {path}: not YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--transformer-config {path}: expected a mapping of TransformerConfig fields")
    known = config_field_names()
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"--transformer-config {path}: {unknown} are not fields of this megatron-core's "
                          "TransformerConfig; remove them")
    objects = sorted(set(data) & set(_OBJECTS))
    if objects:
        raise ConfigError(f"--transformer-config {path}: {objects} hold functions or objects a YAML file cannot give; "
                          "remove them (the checkers build the model with SwiGLU, F.silu)")
    return dict(data)


def _field_names(cls):
    return {f.name for f in dataclasses.fields(cls)}


def _mla_only_fields():
    plain, *mla = config_classes()
    return _field_names(mla[0]) - _field_names(plain) if mla else set()


def config_field_names():
    return set().union(*(_field_names(cls) for cls in config_classes()))


# MLATransformerConfig's fields that are GPTModel arguments of a model without MLA: the checkers
# take them from the model (the model YAML's rotary_base and rotary_percent).
_GPT_ARGUMENTS = {"rotary_base": lambda spec: spec.rotary_base, "rotary_percent": lambda spec: spec.rotary_percent}


def apply(kwargs: Dict[str, Any], fields: Dict[str, Any], spec: Any) -> Dict[str, Any]:
    """``kwargs`` (the checker's TransformerConfig arguments) with ``fields`` over them; a field the
    checker sets from its flags or the model (``spec``) may only repeat the checker's value."""
    model = spec.name
    fields = dict(fields)
    mla_only = set() if fields.get("multi_latent_attention") else _mla_only_fields()
    for name in [n for n in fields if n in mla_only]:
        value = fields.pop(name)
        if name in _GPT_ARGUMENTS and float(value) == float(_GPT_ARGUMENTS[name](spec)):
            continue  # the value the model's GPTModel gets anyway
        if name in _GPT_ARGUMENTS:
            raise ConfigError(f"--transformer-config: {name}={value!r} is a GPTModel argument the checker takes from "
                              f"the model ({model}: {_GPT_ARGUMENTS[name](spec)!r}); remove it from the file, or give "
                              f"a model YAML with {name} (--model FILE.yaml)")
        raise ConfigError(f"--transformer-config: {name} is a field of megatron-core's MLATransformerConfig, read only "
                          f"with multi_latent_attention (refused); remove {name} from the file")
    for name, value in fields.items():
        if name in FROM_CHECKER and name in kwargs and kwargs[name] != value:
            where = _FLAG_OF.get(name, f"the model ({model}; give another model YAML with --model)")
            raise ConfigError(f"--transformer-config: {name}={value!r} differs from {kwargs[name]!r}, which the "
                              f"checker sets from {where}; remove {name} from the file or change it there")
    out = dict(kwargs)
    out.update(fields)
    return out


def add_argument(parser) -> None:
    parser.add_argument("--transformer-config", metavar="FILE.yaml",
                        help="YAML mapping of megatron-core TransformerConfig fields (the config you train with: "
                             "verl's override_transformer_config, Megatron-LM's arguments) applied over the bundled "
                             "model's; every field is honoured or refused by name (exit 2)")
