"""Build a megatron-core GPTModel (local spec) for the current parallel state from a ModelSpec."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

import torch
import torch.nn.functional as F

from ..contract.profile import Profile
from ..models.layout import Layout
from ..models.marks import mark_true_vocab
from ..models.spec import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The user's --transformer-config fields (check/user_config.py), set once per checker process.
_USER_FIELDS: dict = {}


def set_user_fields(fields: dict) -> None:
    _USER_FIELDS.clear()
    _USER_FIELDS.update(fields)


def _moe_kwargs(spec: ModelSpec, layout: Layout, dispatcher: str) -> dict:
    if not spec.is_moe:
        return {}
    kw = dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size,
        moe_router_topk=spec.moe_router_topk,
        moe_router_score_function=spec.moe_router_score_function,
        moe_router_pre_softmax=spec.moe_router_pre_softmax,
        moe_router_enable_expert_bias=spec.moe_router_enable_expert_bias,
        moe_router_topk_scaling_factor=spec.moe_router_topk_scaling_factor,
        moe_router_num_groups=spec.moe_router_num_groups,
        moe_router_group_topk=spec.moe_router_group_topk,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        moe_router_load_balancing_type=spec.moe_router_load_balancing_type or (
            "aux_loss" if spec.moe_aux_loss_coeff else "none"),
        moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
        moe_z_loss_coeff=spec.moe_z_loss_coeff,
        moe_expert_capacity_factor=spec.moe_expert_capacity_factor,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    if spec.first_k_dense:
        kw["moe_layer_freq"] = [0] * spec.first_k_dense + [1] * (spec.num_layers - spec.first_k_dense)
    return kw


def _mla_kwargs(spec: ModelSpec) -> dict:
    """MLATransformerConfig's fields (megatron's names and meaning, models/spec.py)."""
    if not spec.multi_latent_attention:
        return {}
    kw = {f: getattr(spec, f) for f in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                         "v_head_dim", "rope_type", "rotary_scaling_factor", "beta_fast", "beta_slow",
                                         "mscale", "mscale_all_dim")}
    kw["rotary_base"] = spec.rotary_base
    if spec.original_max_position_embeddings:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        # YaRN's original context; megatron-core 0.12 names it max_position_embeddings
        fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
        name = "original_max_position_embeddings" if "original_max_position_embeddings" in fields else \
            "max_position_embeddings"
        kw[name] = spec.original_max_position_embeddings
    return kw


def _line_fields(wanted: dict):
    """(the fields of ``wanted`` -- name: (the model's value, the default) -- that this megatron-core line's
    TransformerConfig has, set wherever it has them so that a --transformer-config value is compared with
    the model's; the names the model needs at another value than the default and the line lacks)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kw = {name: value for name, (value, _) in wanted.items() if name in fields}
    missing = [name for name, (value, default) in wanted.items() if name not in fields and value != default]
    return kw, missing


def _attention_kwargs(spec: ModelSpec) -> dict:
    """gpt-oss' attention: sinks (softmax_type 'learnable') and windows alternating with full layers
    (window_attn_skip_freq); on a line without the fields a ConfigError names them."""
    from ..errors import ConfigError

    kw, missing = _line_fields({"softmax_type": ("learnable" if spec.attention_sinks else "vanilla", "vanilla"),
                                "window_attn_skip_freq": (spec.window_attn_skip_freq, None)})
    if missing:
        import megatron.core

        raise ConfigError(f"model {spec.name}: TransformerConfig has no {', '.join(missing)} in megatron-core "
                          f"{megatron.core.__version__} (attention_sinks, window_attn_skip_freq need 0.15 or later)")
    return kw


def _glu_kwargs(spec: ModelSpec) -> dict:
    """The gated MLP's activation; a clamp or an offset where the model has one (megatron-core >= 0.14
    has the fields: on an older line a ConfigError names them)."""
    from ..errors import ConfigError

    clamp = None if spec.activation_func_clamp_value is None else float(spec.activation_func_clamp_value)
    kw, missing = _line_fields({"activation_func_clamp_value": (clamp, None),
                                "glu_linear_offset": (float(spec.glu_linear_offset), 0.0)})
    if spec.activation_func == "quick_gelu":
        try:
            from megatron.core.fusions.fused_bias_geglu import quick_gelu
        except ImportError:
            quick_gelu = None
        kw["activation_func"] = quick_gelu
    else:
        kw["activation_func"] = F.silu
    if kw["activation_func"] is None or missing:
        import megatron.core

        lacks = ", ".join(missing) if missing else "quick_gelu (megatron.core.fusions.fused_bias_geglu)"
        raise ConfigError(f"model {spec.name}: its gated MLP (activation_func={spec.activation_func!r}, "
                          f"activation_func_clamp_value, glu_linear_offset) needs what megatron-core "
                          f"{megatron.core.__version__}'s TransformerConfig has no: {lacks}; use megatron-core >= 0.14 "
                          f"or a SwiGLU model")
    return kw


def transformer_config(spec: ModelSpec, layout: Layout, dtype: torch.dtype, dispatcher: str = "alltoall",
                       user_fields=None, **overrides):
    """The model's TransformerConfig for ``layout``; ``overrides``: training settings (recompute,
    per-token loss, ...) on top, then the user's --transformer-config fields (``user_fields``, default
    the ones ``set_user_fields`` gave)."""
    from megatron.core.transformer import transformer_config as tc

    from ..errors import ConfigError
    from . import user_config

    config_class = tc.MLATransformerConfig if spec.multi_latent_attention else tc.TransformerConfig
    kwargs = dict(
        **_moe_kwargs(spec, layout, dispatcher),
        **_mla_kwargs(spec),
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    if layout.vpp > 1:
        kwargs["virtual_pipeline_model_parallel_size"] = layout.vpp
    if spec.sliding_window is not None:  # Hugging Face's W keys, the query's own included
        kwargs["window_size"] = (spec.sliding_window - 1, 0)
    kwargs.update(_glu_kwargs(spec))
    kwargs.update(_attention_kwargs(spec))
    kwargs.update(overrides)
    fields = _USER_FIELDS if user_fields is None else user_fields
    kwargs = user_config.apply(kwargs, fields, spec)
    try:
        config = config_class(**kwargs)
    except (ValueError, AssertionError, TypeError) as exc:
        if spec.add_bias_linear and spec.is_moe and isinstance(exc, AssertionError) and "bias" in str(exc).lower():
            from .. import compat

            # megatron-core 0.12's config asserts "Bias is not supported for MoE"
            raise ConfigError(f"model {spec.name}: add_bias_linear with MoE layers (the router's and the experts' "
                              f"biases): megatron-core {compat.megatron_version()} builds none ({exc}); use a line that "
                              f"does (0.16 and later), or add_bias_linear: false") from None
        if not fields:
            raise
        # megatron's own __post_init__ rejects some refused settings first (overlap_moe_expert_parallel_comm
        # without EP): the file's refused fields are named before megatron's message
        from types import SimpleNamespace

        from ..contract.model_config import check_refused_fields

        check_refused_fields(SimpleNamespace(**fields))
        raise ConfigError(f"--transformer-config: megatron-core's TransformerConfig rejects the settings: "
                          f"{type(exc).__name__}: {exc}") from None
    # The true vocab size, stated on the config as Megatron-Bridge's model providers do: the
    # logprob/loss patch excludes the padded columns (GPTModel gets the padded size).
    config.vocab_size = spec.vocab_size
    return config


def build_gpt_stage(
    spec: ModelSpec, layout: Layout, dtype: torch.dtype, profile: Profile, dispatcher: str = "alltoall"
):
    """The GPTModel chunk this rank holds (pre/post-process by pipeline stage), in eval mode."""
    model = _build_gpt(spec, layout, dtype, profile, transformer_config(spec, layout, dtype, dispatcher))
    model.eval()
    return model


def build_gpt_chunks(spec: ModelSpec, layout: Layout, dtype: torch.dtype, profile: Profile,
                     dispatcher: str = "alltoall", **config_overrides):
    """The model chunks this rank holds for training (one per virtual pipeline stage, ``layout.vpp``),
    in train mode, all sharing one TransformerConfig (``config_overrides`` on top)."""
    from .. import compat

    config = transformer_config(spec, layout, dtype, dispatcher, **config_overrides)
    chunks = []
    for vp_stage in range(layout.vpp):
        with compat.virtual_pipeline_stage(vp_stage if layout.vpp > 1 else None) as (model_kwargs, stage_kwargs):
            chunks.append(_build_gpt(spec, layout, dtype, profile, config, model_kwargs, stage_kwargs))
    for chunk in chunks:
        chunk.train()
    return chunks


def _build_gpt(spec: ModelSpec, layout: Layout, dtype: torch.dtype, profile: Profile, config, model_kwargs=None,
               stage_kwargs=None):
    """One GPTModel chunk; model_kwargs / stage_kwargs: the virtual pipeline stage (compat)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    model_kwargs, stage_kwargs = model_kwargs or {}, stage_kwargs or {}
    if spec.is_moe and spec.first_k_dense:
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                                **model_kwargs)
    else:
        layer_spec = get_gpt_layer_local_spec(
            num_experts=spec.num_experts, qk_layernorm=spec.qk_layernorm, normalization="RMSNorm",
            multi_latent_attention=spec.multi_latent_attention,
        )
    if spec.multi_latent_attention and spec.q_lora_rank is None:
        _without_query_latent_norm(layer_spec)
    if spec.rope_scaling_factor is not None:  # Llama-3's scaled RoPE
        model_kwargs = dict(model_kwargs, rope_scaling=True, rope_scaling_factor=spec.rope_scaling_factor)
    if spec.rotary_percent != 1.0:  # partial rotary (GLM-4.5)
        model_kwargs = dict(model_kwargs, rotary_percent=spec.rotary_percent)
    yarn = spec.rope_type == "yarn" and not spec.multi_latent_attention
    if yarn:
        _set_yarn_attributes(config, spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab(profile),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(**stage_kwargs),
        post_process=parallel_state.is_pipeline_last_stage(**stage_kwargs),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="yarn" if yarn else "rope",
        rotary_base=int(spec.rotary_base),
        **model_kwargs,
    )
    # The true vocab marked on the model: its config's vocab_size equal to the padded one (nothing
    # padded) would otherwise be ambiguous (models/marks.py).
    mark_true_vocab(model, spec.vocab_size)
    model.to(dtype)
    return model


def _set_yarn_attributes(config, spec: ModelSpec) -> None:
    """GPTModel's YaRN (position_embedding_type yarn) reads its settings from the config's yarn_*
    attributes, which TransformerConfig does not declare (Megatron-Bridge's providers carry them):
    set as megatron reads them, or a ConfigError on a line whose GPTModel has no YaRN."""
    from .. import compat
    from ..errors import ConfigError

    if not compat.gpt_model_has_yarn():
        import megatron.core

        raise ConfigError(f"model {spec.name}: rope_type yarn: megatron-core {megatron.core.__version__}'s GPTModel has "
                          f"no position_embedding_type 'yarn'; use megatron-core >= 0.14 or plain RoPE")
    for name, value in (("yarn_rotary_scaling_factor", spec.rotary_scaling_factor),
                        ("yarn_original_max_position_embeddings", spec.original_max_position_embeddings),
                        ("yarn_beta_fast", spec.beta_fast), ("yarn_beta_slow", spec.beta_slow),
                        ("yarn_mscale", spec.mscale), ("yarn_mscale_all_dim", spec.mscale_all_dim),
                        ("yarn_correction_range_round_to_int", spec.correction_range_round_to_int)):
        setattr(config, name, value)


def _without_query_latent_norm(layer_spec) -> None:
    """MLA without a query latent has no query norm: megatron's local spec still names one (0.16 builds
    it unused, 0.19 refuses it), so the spec gets an IdentityOp there, as Megatron-Bridge builds it."""
    from megatron.core.transformer.identity_op import IdentityOp

    for layer in getattr(layer_spec, "layer_specs", None) or [layer_spec]:
        layer.submodules.self_attention.submodules.q_layernorm = IdentityOp


def check_before_launch(spec, layouts, profile, dtype, fields: Dict[str, Any], dispatcher: str = "alltoall") -> None:
    """Build each layout's TransformerConfig with the user's fields and run the refusal checks a
    user's GPTModel construction runs: bad settings exit 2 here, before any process starts."""
    if not fields:
        return
    from ..contract.model_config import check_model_config

    for layout in layouts:
        config = transformer_config(spec, layout, dtype, dispatcher, user_fields=fields)
        check_model_config(config, profile, training=True)
