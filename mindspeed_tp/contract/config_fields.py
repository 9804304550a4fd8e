"""Every TransformerConfig (and MLATransformerConfig) field of the supported megatron-core lines,
classified once: honoured (the check or test that shows its bits are kept), refused (the refusal key
``contract/model_config.py`` or a patch raises), or irrelevant to the numerics (why).
tests/test_config_fields.py walks the installed megatron-core's fields: one a new line adds fails it
until it is classified here. The user's ``--transformer-config`` (check/user_config.py) reads the
fields the checker takes from its own flags and model from ``FROM_CHECKER``."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Tuple

_LAYOUT = "tests/test_parity_dense.py::test_every_layout_bitwise_equal_to_single_device"
_MOE = "tests/test_parity_moe.py::test_logprobs_and_routing_bitwise_equal_to_one_device"
_CP = "tests/test_context_parallel.py::test_cp_layouts_logprobs_bitwise_equal_to_one_device"
_TRAIN = "tests/test_train_check.py::test_step1_loss_and_in_step_logprobs_bitwise_in_every_layout"
_RECOMPUTE = "tests/test_train_check.py::test_activation_recomputation_gives_the_same_bits"
_ROLLOUT = "tests/test_rollout_parity.py::test_training_logprobs_equal_the_rollout_engine"
_ENGINE = "tests/test_reference_engine.py::test_engine_weights_and_rope_match_megatron_tp1"
_AUX = "tests/test_moe_aux_loss.py::test_router_loss_values_equal_vanilla"
_BITWISE = "tests/test_bitwise_training.py::test_every_step_bitwise_in_every_layout"
_MOE_BITWISE = "tests/test_bitwise_moe_training.py::test_every_moe_step_bitwise_in_every_layout"
# a field the bundled runs leave at its default, launched at another value
_AT = "tests/test_honoured_fields.py::test_an_honoured_field_at_another_value_is_bitwise_across_layouts[{}]"


def _at(*names: str) -> Dict[str, str]:
    return {name: _AT.format(name) for name in names}


def _all(names: str, value: str) -> Dict[str, str]:
    return {name: value for name in names.split()}


HONOURED: Dict[str, str] = {
    **_all("tensor_model_parallel_size sequence_parallel pipeline_model_parallel_size", _LAYOUT),
    **_all("expert_model_parallel_size expert_tensor_parallel_size", _MOE),
    "context_parallel_size": _CP,
    "virtual_pipeline_model_parallel_size": _TRAIN,
    **_all("num_layers hidden_size num_attention_heads num_query_groups ffn_hidden_size kv_channels layernorm_epsilon "
           "gated_linear_unit activation_func bf16 params_dtype pipeline_dtype", _ROLLOUT),
    **_at("qk_layernorm", "normalization", "moe_router_pre_softmax", "cp_comm_type", "recompute_method",
          "recompute_modules", "distribute_saved_activations", "moe_router_bias_update_rate", "softmax_type",
          "window_attn_skip_freq", "activation_func_clamp_value", "glu_linear_offset", "add_bias_linear"),
    "max_position_embeddings": _ENGINE,  # megatron-core 0.12: the RoPE table's length
    **_all("num_moe_experts moe_ffn_hidden_size moe_router_topk moe_router_score_function "
           "moe_shared_expert_intermediate_size moe_layer_freq moe_router_topk_scaling_factor "
           "moe_token_dispatcher_type moe_router_load_balancing_type", _MOE),
    **_all("moe_aux_loss_coeff moe_z_loss_coeff", _AUX),
    **_all("recompute_granularity recompute_num_layers", _RECOMPUTE),
    "calculate_per_token_loss": _BITWISE,
    "moe_router_enable_expert_bias": _MOE_BITWISE,
    # Mistral's sliding window (left, 0): scored bitwise across layouts, with chunked prefill and decode
    "window_size": "tests/test_families.py::test_bitwise_training_two_layouts[mistral]",
    # Qwen2 / Qwen2.5, GLM-4.5: scored bitwise across layouts, trained bitwise (its gradient a token sum in
    # fixed order)
    "add_qkv_bias": "tests/test_families_moe.py::test_bitwise_training_two_layouts[glm45]",
    # group-limited routing: kernels/moe.group_limited, the same groups on every rank
    **{name: "tests/test_honoured_fields.py::test_an_honoured_field_at_another_value_is_bitwise_across_layouts"
       for name in ("moe_router_num_groups", "moe_router_group_topk")},
    # multi-latent attention (MLATransformerConfig): DeepSeek-V3's shape (query latent, YaRN) and
    # Moonlight's (one query projection, plain RoPE), each scored bitwise across TP / SP / PP / EP
    **_all("multi_latent_attention q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim rope_type "
           "rotary_scaling_factor original_max_position_embeddings beta_fast beta_slow mscale mscale_all_dim",
           "tests/test_mla.py::test_mla_logprobs_bitwise_across_layouts[tiny-deepseek-v3]"),
    "rotary_base": "tests/test_mla.py::test_mla_logprobs_bitwise_across_layouts[tiny-mla]",
}

# field -> refusal key (contract/refusals.py); the refusal names the field and the value to set.
REFUSED: Dict[str, str] = {
    **{name: name for name in (
        "bias_activation_fusion fused_single_qkv_rope softmax_scale "
        "rotary_interleaved fp32_residual_connection apply_residual_connection_post_layernorm fp16 enable_autocast "
        "gradient_accumulation_fusion cross_entropy_loss_fusion enable_cuda_graph external_cuda_graph cuda_graph_impl "
        "apply_query_key_layer_scaling layernorm_zero_centered_gamma moe_router_dtype "
        "moe_expert_capacity_factor moe_pad_expert_input_to_capacity moe_input_jitter_eps "
        "moe_router_topk_limited_devices moe_grouped_gemm "
        "moe_permute_fusion moe_router_fusion moe_shared_expert_overlap moe_apply_probs_on_input "
        "moe_shared_expert_gate moe_enable_deepep moe_latent_size moe_router_force_load_balancing "
        "moe_enable_routing_replay gtp_remat_size").split()},
    # > 0 while training (a forward-only pass runs without dropout)
    "attention_dropout": "attention_dropout",
    "hidden_dropout": "hidden_dropout",
    "defer_embedding_wgrad_compute": "defer_embedding_wgrad_compute_config",
    "bias_dropout_fusion": "vllm_bias_dropout_fusion",  # engine profiles; elsewhere megatron's own add, unchanged
    **_all("fp8 fp4 use_kitchen quant_recipe", "low_precision"),
    **_all("qk_l2_norm qk_clip attention_output_gate experimental_attention_variant linear_attention_freq no_rope_freq "
           "mrope_section is_hybrid_model heterogeneous_block_specs mtp_num_layers use_te_activation_func "
           "moe_extended_tp moe_token_dropping moe_router_padding_for_quantization moe_router_padding_for_fp8 "
           "hybrid_context_parallel batch_invariant_mode flash_decode use_inference_optimized_layers "
           "inference_fuse_tp_communication symmetric_ar_type mlp_chunks_for_prefill", "architecture_variant"),
    # MLA's inference latent cache and fused down projection, and a partial rotary of its rope channels
    **_all("rotary_percent cache_mla_latents mla_down_proj_fusion", "multi_latent_attention"),
    **_all("dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss "
           "linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim linear_num_key_heads "
           "linear_num_value_heads mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads "
           "use_mamba_mem_eff_path mtp_loss_scaling_factor hetereogenous_dist_checkpoint qk_clip_alpha "
           "qk_clip_threshold", "architecture_variant"),
    **_all("fp8_recipe fp8_param fp8_quantizer_factory fp8_margin fp8_interval fp8_amax_history_len "
           "fp8_amax_compute_algo fp8_wgrad fp8_dot_product_attention fp8_multi_head_attention tp_only_amax_red "
           "first_last_layers_bf16 num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 use_kitchen_attention "
           "kitchen_attention_backend fp4_recipe fp4_param fp4_quantizer_factory activation_func_fp8_input_store",
           "low_precision"),
    **_all("moe_use_legacy_grouped_gemm overlap_dispatch_backward_with_experts_wgrad moe_single_grouped_weight "
           "moe_single_grouped_bias moe_mlp_glu_interleave_size", "moe_grouped_gemm"),
    # megatron-core 0.19: weights sharded over a further group, gathered inside megatron's autograd
    **_all("tensor_parallel_num_weight_shards gtp_weight_remat_size expert_tensor_parallel_num_weight_shards "
           "expert_gtp_weight_remat_size", "gtp_remat_size"),
    **_all("use_mup mup_width_mult mup_base_hidden_size mup_embedding_mult mup_output_mult mup_base_head_dim "
           "mup_attn_scale_power mtp_use_repeated_layer mtp_detach_heads mtp_hybrid_override_pattern "
           "experimental_attention_variant_loss_scale_func dsa_indexer_topk_freq dsa_indexer_skip_topk_offset "
           "dsa_kernel_backend dsa_indexer_rope_interleaved dsa_indexer_rotate_activation dsa_indexer_scoring_relu "
           "dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32 use_grouped_gemm_for_shared_expert "
           "moe_shared_expert_glu_interleave_size use_grouped_gemm_for_dense_mlp moe_router_quantile_balancing_ema "
           "moe_router_force_biased nccl_all_reduce_for_prefill mamba_training_ssm_states_dtype "
           "mlp_chunks_for_training", "architecture_variant"),
    "fp8_output_proj": "low_precision",
    **_all("moe_permute_fusion_into_hybridep moe_hybridep_pad_uneven_dispatch_inputs moe_flex_dispatcher_num_sms "
           "moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms_preprocessing "
           "moe_ncclep_static_shape moe_ncclep_zero_copy moe_expert_rank_capacity_factor", "moe_token_dispatcher_type"),
    **_all("moe_pad_experts_for_cuda_graph_inference cuda_graph_modules inference_cuda_graph_scope", "cuda_graph_impl"),
    **_all("moe_flex_dispatcher_backend moe_deepep_num_sms moe_hybridep_num_sms", "moe_token_dispatcher_type"),
    **_all("hierarchical_context_parallel_sizes", "context_parallel_comm_type"),
    "max_seqlen_per_dp_cp_rank": "architecture_variant",  # hybrid_context_parallel's
    **_all("cuda_graph_use_single_mempool cuda_graph_retain_backward_graph cuda_graph_warmup_steps cuda_graph_scope",
           "cuda_graph_impl"),
    **_all("moe_token_drop_policy", "moe_expert_capacity_factor"),
    "moe_layer_recompute": "moe_layer_recompute",
    "wgrad_deferral_limit": "defer_embedding_wgrad_compute_config",
    "cross_entropy_fusion_impl": "cross_entropy_loss_fusion",
    # megatron's combined 1F1B schedule calls the MoE layer's pieces directly, not the patched forward
    **_all("overlap_moe_expert_parallel_comm delay_wgrad_compute ep_overlap_early_attn_memory_release",
           "moe_expert_overlap"),
}

_NO_MATH = "where or when tensors move or are kept, not what is computed"
_TRAINING_LOOP = "a callback or object the training loop sets; megatron's functions behind it are patched where they sum"
_INIT = "initial values only; the checked runs load or seed their weights"
_TE = "Transformer Engine only; the local spec is required (refusal transformer_engine)"
IRRELEVANT: Dict[str, str] = {
    **_all("pipeline_model_parallel_comm_backend overlap_p2p_comm batch_p2p_comm batch_p2p_sync use_ring_exchange_p2p "
           "deallocate_pipeline_outputs overlap_p2p_comm_warmup_flush microbatch_group_size_per_vp_stage "
           "variable_seq_lengths async_tensor_model_parallel_allreduce cpu_offloading cpu_offloading_num_layers "
           "_cpu_offloading_context cpu_offloading_activations cpu_offloading_weights cpu_offloading_double_buffering "
           "fine_grained_activation_offloading offload_modules min_offloaded_tensor_size "
           "clone_scatter_output_in_embedding disable_parameter_transpose_cache barrier_with_L1_time "
           "pipeline_model_parallel_split_rank pipeline_model_parallel_layout num_layers_in_first_pipeline_stage "
           "num_layers_in_last_pipeline_stage account_for_embedding_in_pipeline_split "
           "account_for_loss_in_pipeline_split mtp_standalone cpu_offloading_retain_pinned_cpu_buffers "
           "delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks activation_offload_fraction "
           "fine_grained_offloading_max_inflight_offloads moe_paged_stash moe_paged_stash_page_size "
           "moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_buffer_size_factor_cpu "
           "high_priority_a2a_comm_stream", _NO_MATH),
    **_all("timers finalize_model_grads_func grad_scale_func no_sync_func grad_sync_func param_sync_func "
           "moe_grad_scale_func mtp_grad_scale_func", _TRAINING_LOOP),
    **_all("perform_initialization use_cpu_initialization init_method output_layer_init_method init_method_std "
           "embedding_init_method embedding_init_method_std init_model_with_meta_device", _INIT),
    **_all("tp_comm_overlap tp_comm_bulk_wgrad tp_comm_bulk_dgrad tp_comm_overlap_ag tp_comm_overlap_rs "
           "tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_atomic_ag tp_comm_split_rs tp_comm_atomic_rs "
           "tp_comm_overlap_disable_qkv tp_comm_overlap_disable_fc1 tp_comm_bootstrap_backend use_te_rng_tracker "
           "transformer_impl flash_attention_version fused_residual_rmsnorm use_transformer_engine_op_fuser", _TE),
    **_all("inference_disable_triton_nvls_kernels inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels "
           "inference_moe_token_dispatcher_type", "megatron-core's own inference engine's kernels; the scored forward is "
           "the training forward (an inference context is refused: inference_context)"),
    "deterministic_mode": "selects deterministic Transformer Engine / NCCL paths; the patched kernels are deterministic",
    "autocast_dtype": "read only with enable_autocast (refused)",
    "attention_backend": "chooses Transformer Engine attention in Megatron-LM's spec; the local attention is patched",
    "attention_softmax_in_fp32": "chooses among megatron's softmax kernels, which the patched attention replaces "
                                 "(its softmax is fp32)",
    "masked_softmax_fusion": "megatron's fused softmax kernel, replaced by the patched attention",
    "apply_rope_fusion": "megatron's fused RoPE kernel, replaced by the patched apply_rotary_pos_emb",
    "persist_layer_norm": "apex / TE LayerNorm option; the patched norm computes itself",
    "memory_efficient_layer_norm": "apex / TE LayerNorm option; the patched norm computes itself",
    "use_fused_weighted_squared_relu": "read only with a squared-ReLU activation (refused: activation_func)",
    "disable_bf16_reduced_precision_matmul": "a cuBLAS flag; the patched GEMMs choose their own accumulation",
    "test_mode": "adds test-only modules checks; no arithmetic of the forward",
    "log_max_attention_logit": "logs a statistic of the attention logits; the forward is unchanged",
    "inference_rng_tracker": "the RNG of inference sampling in megatron's engine, not the scored forward",
    "inference_sampling_seed": "the seed of megatron's inference sampling, not the scored forward",
    "config_logger_dir": "writes the config to a directory",
    "moe_per_layer_logging": "records the router losses per layer in megatron's loss tracker (for logging); the "
                             "losses and their gradients are unchanged",
    "num_microbatches_with_partial_activation_checkpoints": "megatron's pipeline schedule passes a flag per "
    "micro-batch to the training script's forward step; no megatron-core module reads it (GPTModel.forward has no "
    "such argument)",
}

# Fields the checkers set from their own flags or the model (--tp, --dtype, --model, ...): a
# --transformer-config file may not set them to something else.
FROM_CHECKER: Tuple[str, ...] = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "sequence_parallel", "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "params_dtype", "pipeline_dtype", "bf16", "num_layers", "hidden_size", "num_attention_heads",
    "num_query_groups", "ffn_hidden_size", "kv_channels", "layernorm_epsilon", "qk_layernorm", "num_moe_experts",
    "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax", "moe_router_score_function",
    "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
    "moe_layer_freq", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type",
    "moe_token_dispatcher_type", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "recompute_modules", "calculate_per_token_loss", "max_position_embeddings", "activation_func_clamp_value",
    "glu_linear_offset", "add_bias_linear", "softmax_type", "window_attn_skip_freq",
)


# Refused fields accepted at a value other than the line's default (any other value is refused
# by ``refused_value``): (accepts, what is accepted). The rest are accepted only at their default.
ACCEPTED: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    # megatron's default is 0.1: a model may be built with it and score (no dropout in eval); the
    # training forward refuses it, and the checkers before they launch (they train the user's config)
    "hidden_dropout": (lambda v: True, "any value while scoring; 0 while training"),
    "attention_dropout": (lambda v: True, "any value while scoring; 0 while training"),
    "moe_router_dtype": (lambda v: v in (None, "fp32"), "'fp32' (None without MoE)"),
    "bias_dropout_fusion": (lambda v: True, "any value without a vllm-cpu profile (those refuse True)"),
}


def config_classes():
    """The installed line's TransformerConfig, and its MLATransformerConfig where it has one."""
    from megatron.core.transformer import transformer_config as tc

    return [c for c in (tc.TransformerConfig, getattr(tc, "MLATransformerConfig", None)) if c is not None]


@functools.lru_cache(maxsize=None)
def line_defaults() -> Dict[str, Tuple[Any, ...]]:
    """Field -> the values the installed megatron-core line gives it unset: the dataclass default,
    and what ``__post_init__`` makes of it (``cuda_graph_scope``'s 'full' becomes [])."""
    classes = config_classes()
    built = classes[0](num_layers=1, hidden_size=64, num_attention_heads=4)
    out: Dict[str, Tuple[Any, ...]] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name in out:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                continue
            out[f.name] = (default, getattr(built, f.name, default))
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 -- values that do not compare are not the default
        return False


def refused_value(field: str, value: Any) -> bool:
    """True when the refused ``field`` at ``value`` must be refused: not its line default (nor
    what ``ACCEPTED`` allows)."""
    if field in ACCEPTED:
        return not ACCEPTED[field][0](value)
    return not any(_same(value, d) for d in line_defaults().get(field, ()))


def accepted_text(field: str) -> str:
    if field in ACCEPTED:
        return ACCEPTED[field][1]
    defaults = line_defaults().get(field)
    return repr(defaults[0]) if defaults else "unset"


def classify(field: str):
    """("honoured", test) | ("refused", key) | ("irrelevant", reason) | None (not classified)."""
    for kind, table in (("honoured", HONOURED), ("refused", REFUSED), ("irrelevant", IRRELEVANT)):
        if field in table:
            return kind, table[field]
    return None
