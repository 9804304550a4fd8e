"""The TransformerConfig check: one function every GPTModel construction under the patches runs
(``patches/models.py``) and the checkers run on the user's ``--transformer-config`` before they
launch anything, so a setting the checker would refuse is refused the same way in training.
Which field is honoured, refused or irrelevant: ``contract/config_fields.py``."""
from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

from . import config_fields, refusals
from .refusals import refuse

# (field, refused when, what it is) for the architecture variants no engine models, named with what
# they are (biases and low precision: check_refused_fields, with their groups' messages). A field a
# megatron-core line lacks reads as None and passes.
_VARIANTS = (
    ("qk_l2_norm", bool, "L2-normalised queries and keys"),
    ("qk_clip", bool, "QK-clip (weights rescaled by the largest attention logit)"),
    ("attention_output_gate", bool, "a gated attention output"),
    ("experimental_attention_variant", lambda v: v is not None, "an experimental attention variant"),
    ("linear_attention_freq", lambda v: v is not None, "linear-attention layers"),
    ("no_rope_freq", lambda v: v is not None, "layers without RoPE"),
    ("mrope_section", lambda v: v is not None, "multimodal RoPE"),
    ("is_hybrid_model", bool, "a hybrid (Mamba) model"),
    ("heterogeneous_block_specs", bool, "heterogeneous layers"),
    ("mtp_num_layers", bool, "multi-token prediction layers"),
    ("use_te_activation_func", bool, "Transformer Engine's activation function"),
    ("moe_extended_tp", bool, "extended tensor parallelism of the experts"),
    ("moe_token_dropping", bool, "token dropping"),
    ("moe_router_padding_for_quantization", bool, "router padding for quantised experts"),
    ("moe_router_padding_for_fp8", bool, "router padding for FP8 experts"),
    ("hybrid_context_parallel", bool, "hybrid context parallelism"),
    ("batch_invariant_mode", bool, "megatron-core's own batch-invariant kernels"),
    ("flash_decode", bool, "flash decoding"),
    ("use_inference_optimized_layers", bool, "inference-optimised layers"),
    ("inference_fuse_tp_communication", bool, "fused inference TP communication"),
    ("symmetric_ar_type", lambda v: v is not None, "symmetric all-reduce kernels"),
    ("mlp_chunks_for_prefill", lambda v: v not in (None, 1), "chunked prefill MLPs"),
    ("mlp_chunks_for_training", lambda v: v not in (None, 1), "chunked training MLPs"),
    ("use_mup", bool, "maximal update parameterisation (its attention and output scales)"),
    ("use_grouped_gemm_for_shared_expert", bool, "a grouped-GEMM shared expert"),
    ("use_grouped_gemm_for_dense_mlp", bool, "a grouped-GEMM dense MLP"),
    ("moe_router_force_biased", lambda v: v is not None, "a random router bias"),
    ("moe_router_load_balancing_type", lambda v: v == "quantile_balancing", "quantile-balancing routing"),
    ("nccl_all_reduce_for_prefill", bool, "NCCL all-reduce kernels of symmetric all-reduce"),
)


NORMALIZATIONS = ("RMSNorm", "LayerNorm")  # what the patched norm computes (patches/norms.py)


@functools.lru_cache(maxsize=None)
def _activation_names():
    """megatron's activation functions the patched MLPs compute (kernels/elementwise.ACTIVATIONS), by
    identity: F.silu (SwiGLU) and megatron's quick_gelu (gpt-oss' GEGLU; megatron-core >= 0.14)."""
    import torch.nn.functional as F

    names = {F.silu: "silu"}
    try:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
    except ImportError:  # a line without it: no config can name it
        return names
    names[quick_gelu] = "quick_gelu"
    return names


def glu_of(config: Any) -> Optional[Tuple[str, Optional[float], float]]:
    """(activation, clamp, offset) of ``config``'s gated MLP as megatron's unfused glu computes it
    (activation_func, activation_func_clamp_value, glu_linear_offset; kernels/elementwise.glu), or
    None where the MLP is not a GLU of an activation the patches compute."""
    if not getattr(config, "gated_linear_unit", False):
        return None
    name = _activation_names().get(getattr(config, "activation_func", None))
    if name is None:
        return None
    clamp = getattr(config, "activation_func_clamp_value", None)
    return name, None if clamp is None else float(clamp), float(getattr(config, "glu_linear_offset", 0.0) or 0.0)


def checked_glu(config: Any) -> Tuple[str, Optional[float], float]:
    """``glu_of(config)``, or the refusal naming activation_func / gated_linear_unit."""
    glu = glu_of(config)
    if glu is None:
        raise refuse("architecture_variant", setting="activation_func / gated_linear_unit",
                     value=(getattr(getattr(config, "activation_func", None), "__name__", None),
                            getattr(config, "gated_linear_unit", None)),
                     what="an MLP other than a gated linear unit of F.silu (SwiGLU) or megatron's quick_gelu "
                          "(gated_linear_unit=True)")
    return glu


def check_router_dtype(config: Any) -> None:
    """MoE: the router computes in fp32 (numerics/canonical/strategy.py); any other setting is refused by name."""
    value = getattr(config, "moe_router_dtype", "fp32")
    if value != "fp32":
        raise refuse("moe_router_dtype", value=value)


def check_model_config(config: Any, profile: Optional[Any] = None, training: bool = False) -> None:
    """Raise the refusal of the first setting of ``config`` (a TransformerConfig) the contract cannot
    keep; ``profile``: the active profile (engine profiles refuse more); ``training``: the config is
    the one a model trains with (the checkers' user config), so dropout is refused now rather than at
    the first training forward."""
    if training:
        for name in ("hidden_dropout", "attention_dropout"):
            if getattr(config, name, 0.0):
                raise refuse(name, value=getattr(config, name))
    refusals.check_config(refusals.MODEL, config)
    refusals.check_config(refusals.ATTENTION, config)
    refusals.check_config(refusals.NORM, config)
    if getattr(config, "normalization", "LayerNorm") not in NORMALIZATIONS:  # before the norms are built
        raise refuse("normalization", value=config.normalization)
    for name, bad, what in _VARIANTS:
        value = getattr(config, name, None)
        if bad(value):
            raise refuse("architecture_variant", setting=name, value=value, what=what)
    checked_glu(config)
    if getattr(config, "multi_latent_attention", False):
        check_mla(config, profile)
    check_cp_comm_type(config)
    check_recompute_modules(config)
    if getattr(config, "num_moe_experts", None):
        refusals.check_config(refusals.MOE, config)
        check_router_dtype(config)
    if profile is not None and profile.engine_name == "vllm":
        refusals.check_config(refusals.ENGINE, config)
    check_refused_fields(config)


def check_mla(config: Any, profile: Optional[Any]) -> None:
    """Multi-latent attention where it was run bitwise: bshd batches without CP, the canonical and
    bitwise-training profiles, its latents recomputed each step."""
    mla = "multi_latent_attention"
    if (getattr(config, "context_parallel_size", 1) or 1) > 1:
        raise refuse(mla, setting="context_parallel_size", value=config.context_parallel_size,
                     fix="set context_parallel_size=1")
    for name in ("cache_mla_latents", "mla_down_proj_fusion"):
        if getattr(config, name, False):
            raise refuse(mla, setting=name, value=getattr(config, name), fix=f"set {name}=False")
    if getattr(config, "rope_type", "rope") not in ("rope", "yarn"):
        raise refuse(mla, setting="rope_type", value=config.rope_type, fix="use rope or yarn")
    if profile is not None:
        check_mla_profile(profile)


def check_mla_profile(profile: Any) -> None:
    """MLA under the profiles that model it: the canonical and bitwise-training profiles, and the real
    vLLM's (its CPU MLA: what of a model it covers is the strategy's check, ``numerics/vllm/mla.py``);
    not the rollout-layout emulation. Also before the checkers launch (models/layout.py, check/main.py)."""
    if profile.engine_name == "vllm":
        return
    if profile.engine_name is not None or profile.rollout_layout:
        raise refuse("multi_latent_attention", setting="profile", value=profile.name,
                     fix="score with a canonical_tree, bitwise_training or vllm-cpu profile: the rollout layout's "
                         "MLA is not modelled")


# Selective recomputation's modules that were run bitwise (tests/test_train_check.py: core_attn;
# tests/test_honoured_fields.py: mlp). megatron's "layernorm" and "moe_act" use its
# CheckpointWithoutOutput (Transformer Engine's FP8 state: on CPU a NameError), "moe" and
# "shared_experts" checkpoint the MoE layer around the patched forward, "mla_up_proj" is MLA's.
RECOMPUTE_MODULES = ("core_attn", "mlp")


def check_recompute_modules(config: Any) -> None:
    if getattr(config, "recompute_granularity", None) != "selective":
        return
    modules = list(getattr(config, "recompute_modules", None) or ())
    if "moe" in modules:
        raise refuse("moe_layer_recompute")
    others = [m for m in modules if m not in RECOMPUTE_MODULES]
    if others:
        raise refuse("recompute_modules", value=modules, others=others)


CP_COMM_TYPES = (None, "p2p", "all_gather")  # what the consistent attention's one all-gather stands for


def check_cp_comm_type(config: Any) -> None:
    """Under CP, megatron gives each layer's attention ``cp_comm_type`` (one value, or one per layer):
    refused here at construction as the attention's own check (patches/context_parallel.py) would
    inside the workers, so the checkers refuse it before launching."""
    if (getattr(config, "context_parallel_size", 1) or 1) <= 1:
        return
    value = getattr(config, "cp_comm_type", None)
    if any(v not in CP_COMM_TYPES for v in (value if isinstance(value, (list, tuple)) else [value])):
        raise refuse("context_parallel_comm_type", value=value)


def check_refused_fields(config: Any) -> None:
    """Every field ``config_fields.REFUSED`` lists, at any value but its default (or what
    ``config_fields.ACCEPTED`` allows), refused naming it: after the specific checks above (their
    messages say more), so a refused field no specific check reads is still refused."""
    for field, key in config_fields.REFUSED.items():
        if not hasattr(config, field):
            continue  # a line without the field (or an MLA field on a plain TransformerConfig)
        value = getattr(config, field)
        if not config_fields.refused_value(field, value):
            continue
        raise _refusal_of(field, value, key)


def _refusal_of(field: str, value: Any, key: str):
    """The group's own message where it names the field it is given and needs nothing more (the
    biases, low precision, the EP overlap), else the generic one with the group's reason."""
    own = refusals.REFUSALS[key]
    if "{setting}" in own.message:
        try:
            return own.error(setting=field, value=value)
        except KeyError:  # the message needs more than the field and its value
            pass
    return refuse("refused_field", field=field, value=value, key=key, reason=own.reason,
                  accepted=config_fields.accepted_text(field))
