"""The patched Megatron forward under a ``vllm-cpu-*`` profile: each patched megatron-core piece
computes what the engine's Qwen3 / Qwen3-MoE / Qwen2 / Llama model computes at TP=R (vllm/model_executor/
models/qwen3.py, qwen3_moe.py, qwen2.py, llama.py, mistral.py, mixtral.py, glm4_moe.py: one decoder, the
QK-norm, the QKV bias, Llama-3's RoPE cache, Mistral's sliding window, GLM-4.5's half-head RoPE and its
grouped sigmoid router with shared experts per family), through the engine's own ops (``kernels``).

Operator order the engine uses and Megatron does not, and how it is reproduced:
- residual stream: the engine's fused-add RMSNorm adds a layer's output to the residual in fp32
  and normalises that *unrounded* sum; Megatron adds in the model dtype and normalises the
  rounded sum. Here the bias-dropout-add returns the fp32 sum (``kernels.fused_add_residual``),
  the norms read it, and the next add rounds it (so the hidden state between layers, and between
  pipeline stages, is fp32 under a bf16 model);
- logits stay in the model dtype (Megatron's patched LM head would return fp32); logprobs by the
  engine's sampler function over the real vocab.
Everything else (qkv and gate/up as one GEMM each, per-head QK-norm, SiLU-and-mul as torch ops,
the vocab-parallel embedding) is the same arithmetic in both, given the engine's GEMM.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...contract.refusals import refuse
from ...errors import ConfigError
from ...kernels.collectives import gather_last_dim, group_size
from ...models.weights import shard, unshard
from . import kernels
from .expert_slices import moe_across_ranks
from .scoring import current_plan

_ready = {}
# Per model config (weakly): the RoPE base and max positions its GPTModel was built with.
_rope = WeakIdKeyDictionary()


def is_vllm(prof) -> bool:
    return prof is not None and prof.engine_name == "vllm"


def check_ready(prof) -> None:
    """At enable time: the engine the profile names is installed, and this CPU selects its kernels."""
    key = (prof.engine.version, prof.engine.cpu_isa)
    if key in _ready:
        return
    from .host import check_profile_isa
    from .refusals import require_vllm

    _ready[key] = (require_vllm(prof.engine.version), check_profile_isa(prof.engine.cpu_isa))


def set_rope(config, base: float, max_positions: int, llama3_factor: Optional[float] = None,
             rotary_percent: float = 1.0) -> None:
    """Recorded at GPTModel construction, for that model's config: the engine's RoPE cache is built
    from these (``llama3_factor``: GPTModel's rope_scaling_factor under rope_scaling;
    ``rotary_percent``: the share of each head's channels rotated, GLM-4.5's 0.5)."""
    _rope[config] = (float(base), int(max_positions), None if llama3_factor is None else float(llama3_factor),
                     float(rotary_percent))


def rope_of(config):
    """(base, max positions, Llama-3 factor or None, rotary percent) of the model built with ``config``."""
    found = _rope.get(config)
    if found is None:
        raise ConfigError("vllm-cpu profile: this model was built before the patches were enabled (its RoPE base "
                          "is unknown); enable mindspeed-tp before building the model")
    return found


# ---------------------------------------------------------------- pieces the patches call

def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Column-parallel GEMM (merged qkv, gate_up, LM head): the engine's GEMM on this rank's output
    columns, in the model dtype (the engine's logits too); a bias (Qwen2's QKV bias: add_qkv_bias;
    add_bias_linear is refused before) its slice, added in the same engine call."""
    return kernels.engine_linear(x, weight, bias=bias)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, normalization: str) -> torch.Tensor:
    if normalization != "RMSNorm":
        raise refuse("vllm_model_shape", what=f"normalization={normalization!r}", engine="RMSNorm",
                     fix="use normalization=RMSNorm")
    return kernels.rms_norm(x, weight, eps)


def residual_add(x_with_bias, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    x, bias = x_with_bias
    if bias is not None:
        raise refuse("vllm_model_shape", what="a bias before the residual add (add_bias_linear)",
                     engine="no biases", fix="unset add_bias_linear")
    if training and prob > 0:
        raise refuse("vllm_model_shape", what="hidden_dropout > 0", engine="no dropout", fix="set hidden_dropout=0")
    return kernels.fused_add_residual(x, residual)


def rope(t: torch.Tensor, config, interleaved: bool, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RoPE on [s, b, heads, dim] at absolute positions 0..s-1 (the scored sequences start at 0), or at
    ``positions`` (s,) (a context-parallel rank's chunks)."""
    base, max_positions, llama3_factor, rotary_percent = rope_of(config)
    s, b, h, d = t.shape
    x = t.reshape(s * b, h, d)
    if positions is None:
        positions = torch.arange(s, device=t.device)
    longest = int(positions.max()) + 1 if positions.numel() else s
    positions = positions.to(t.device).repeat_interleave(b)
    out = kernels.rotary(x, positions, base, max(max_positions, longest), neox=not interleaved,
                         llama3_factor=llama3_factor, rotary_dim=int(d * rotary_percent))
    return out.reshape(s, b, h, d)


def attention(query, key, value, scale: float, causal: bool, window: Optional[int] = None) -> torch.Tensor:
    """DotProductAttention: query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np*hn];
    ``window``: megatron-core's left window (its window_size (left, 0)), the engine's W = left + 1."""
    if not causal:
        raise refuse("vllm_model_shape", what="non-causal attention", engine="causal decoder attention",
                     fix="use attn_mask_type causal")
    sq, b, np_, hn = query.shape
    plan = current_plan(b)
    if max(plan.prompt_lens) > sq:
        raise ConfigError(f"engine_scoring: a prompt length exceeds the scored sequence length {sq}")
    out = kernels.attention(query.permute(1, 0, 2, 3), key.permute(1, 0, 2, 3), value.permute(1, 0, 2, 3),
                            plan, scale, -1 if window is None else int(window) + 1)
    return out.permute(1, 0, 2, 3).reshape(sq, b, np_ * hn)


def logprob_rows(full_vocab_logits: torch.Tensor) -> torch.Tensor:
    """Rows of full (padded) vocab logits -> the engine's fp32 logprobs over the real vocab, padded
    back with -inf columns (zero probability, so backward needs no special case)."""
    vocab = current_plan().vocab_size
    real = kernels.logprobs(full_vocab_logits[..., :vocab])
    pad = full_vocab_logits.shape[-1] - vocab
    if pad == 0:
        return real
    return torch.cat([real, real.new_full((*real.shape[:-1], pad), float("-inf"))], dim=-1)


# ---------------------------------------------------------------- MoE

_EXPERTS_ATTR = "_mindspeed_tp_vllm_experts"


def _local_experts(layer):
    """This rank's expert shards as (E/EP, 2I/ETP, H) gate|up and (E/EP, H, I/ETP) down
    (differentiable stacks; megatron's fc1 shard is its gate part then its up part)."""
    experts = layer.experts.local_experts
    return (torch.stack([e.linear_fc1.weight for e in experts]), torch.stack([e.linear_fc2.weight for e in experts]),
            [w for e in experts for w in (e.linear_fc1.weight, e.linear_fc2.weight)])


def _prepacked_all_experts(layer, prof, w13, w2, weights):
    """Without expert parallelism: every engine rank's slice of this rank's (all) experts, prepacked
    once per weight version (the engine holds them the same way)."""
    from .. import weight_caches

    key = weight_caches.key(weights)
    entry = getattr(layer, _EXPERTS_ATTR, None)
    if entry is None or not weight_caches.fresh(entry[0], entry[1], weights, key, "the engine's prepacked expert weights"):
        entry = (key, weight_caches.checksum(weights)) + kernels.prepack_experts(
            w13.detach(), w2.detach(), prof.rollout_tp, layer.config.moe_router_topk)
        setattr(layer, _EXPERTS_ATTR, entry)
    return entry[2], entry[3]


def grouped_router(model) -> bool:
    """The engine runs this model's MoE as GLM-4.5's block (sigmoid scores, grouped top-k on score +
    expert bias, routed scaling, shared experts), else as Qwen3-MoE's / Mixtral's (softmax top-k)."""
    return getattr(model, "moe_router_score_function", "softmax") == "sigmoid"


def moe_problems(model, prof) -> list:
    """What the profiles' MoE (the engine's Qwen3-MoE / Mixtral block, or GLM-4.5's) does not model,
    from a TransformerConfig or a model spec (the same field names): checked before an engine starts
    and again at each MoE layer."""
    problems = []
    shared = getattr(model, "moe_shared_expert_intermediate_size", None)
    scaling = getattr(model, "moe_router_topk_scaling_factor", None)
    if grouped_router(model):
        family = getattr(model, "family", None)  # a model spec's: the architecture its checkpoint exports as
        if family is not None and family not in ("glm4_moe", "deepseek_v3"):
            problems.append(f"a sigmoid router is GLM-4.5's or DeepSeek-V3's MoE block in the engine: family "
                            f"glm4_moe or deepseek_v3 (family {family!r} exports an architecture without it)")
        if not getattr(model, "moe_router_enable_expert_bias", False):
            problems.append("a sigmoid router needs the expert bias (moe_router_enable_expert_bias: the engine's "
                            "GLM-4.5 block always adds its e_score_correction_bias)")
        if model.moe_router_topk < 2:
            problems.append("moe_router_topk 1 with a sigmoid router: the engine renormalises the one weight to 1 "
                            "(norm_topk_prob), megatron keeps the score")
        groups, group_topk = getattr(model, "moe_router_num_groups", None), getattr(model, "moe_router_group_topk", None)
        if groups and groups > 1 and model.moe_router_topk // (group_topk or 1) != 2:
            problems.append(f"moe_router_topk / moe_router_group_topk = {model.moe_router_topk} / {group_topk}: the "
                            "engine scores a group by its top 2 experts")
        if getattr(model, "moe_shared_expert_gate", False):
            problems.append("a gated shared expert (moe_shared_expert_gate) is not modelled")
    else:
        if getattr(model, "moe_router_score_function", "softmax") != "softmax":
            problems.append("moe_router_score_function must be softmax (Qwen3-MoE, Mixtral) or sigmoid (GLM-4.5)")
        if shared:
            problems.append("shared experts with a softmax router are not modelled (Qwen3-MoE and Mixtral have "
                            "none; GLM-4.5's sigmoid router has them)")
        if getattr(model, "moe_router_enable_expert_bias", False) or scaling:
            problems.append("expert bias / top-k scaling with a softmax router are not modelled")
        if getattr(model, "moe_router_group_topk", None):
            problems.append("group-limited routing with a softmax router is not modelled")
    inter = model.moe_ffn_hidden_size or model.ffn_hidden_size
    if (inter // prof.rollout_tp) % kernels.MOE_ALIGNMENT or model.hidden_size % kernels.MOE_ALIGNMENT:
        problems.append(f"moe_ffn_hidden_size/rollout_tp={inter // prof.rollout_tp} and hidden_size="
                        f"{model.hidden_size} must be multiples of {kernels.MOE_ALIGNMENT} (else the engine pads)")
    return problems


def check_moe(layer, prof) -> None:
    config = layer.config
    problems = moe_problems(config, prof)
    if not getattr(config, "gated_linear_unit", False):
        problems.append("experts must be SwiGLU (gated_linear_unit=True)")
    if problems:
        raise refuse("vllm_moe", problems="; ".join(problems))


def _route(layer, h):
    """The engine's router logits and routing for tokens ``h``: Qwen3-MoE's / Mixtral's gate in the
    model dtype and softmax top-k, or the grouped sigmoid top-k after GLM-4.5's fp32 gate (its
    GateLinear holds an fp32 copy of the weight; the input cast exactly) or DeepSeek-V3's gate in the
    model dtype (deepseek_v2.py's GateLinear without ``moe_router_dtype``; the family with multi-latent
    attention, which GLM-4.5 has not)."""
    config = layer.config
    weight = layer.router.weight
    if not grouped_router(config):
        logits = kernels.engine_linear(h, weight.to(h.dtype))
        return kernels.route(logits, config.moe_router_topk, not bool(getattr(config, "moe_router_pre_softmax", False)))
    if getattr(config, "multi_latent_attention", False):
        logits = kernels.engine_linear(h, weight.to(h.dtype))
    else:
        logits = kernels.engine_linear(h.float(), weight.float(), source=weight)
    return kernels.grouped_route(logits, config.moe_router_topk, True, config.moe_router_num_groups or 1,
                                 config.moe_router_group_topk or 1, layer.router.expert_bias)


def moe(layer, hidden_states, prof, publish_routing) -> torch.Tensor:
    """MoELayer as the engine's Qwen3MoeSparseMoeBlock / MixtralMoE / Glm4MoE / DeepseekV2MoE: its router (``_route``),
    its fused MoE kernel per engine rank's intermediate slice of every expert, each engine rank's
    output (with GLM-4.5's routed scaling and its shared experts' partial: ``shared_expert_partials``)
    added as its all-reduce does. Under expert (tensor) parallelism the expert group's ranks split
    that work by slice (``expert_slices``); without it this rank runs every slice on its tokens."""
    check_moe(layer, prof)
    shape, dtype = hidden_states.shape, hidden_states.dtype
    h = hidden_states.reshape(-1, shape[-1])
    topk_w, topk_ids = _route(layer, h)
    publish_routing(layer, topk_ids.long())
    from megatron.core import parallel_state as ps

    w13, w2, weights = _local_experts(layer)
    add_dtype = torch.float32 if prof.rollout_allreduce_dtype == "float32" else dtype
    group = ps.get_expert_tensor_and_model_parallel_group()
    if group_size(group) > 1:  # the work cut by engine slice; no rank gathers every expert
        partials = moe_across_ranks(h, topk_w, topk_ids, w13, w2, prof.rollout_tp, layer.config.moe_router_topk,
                                    group, ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())
    else:
        packed, isa = _prepacked_all_experts(layer, prof, w13, w2, weights)
        partials = kernels.fused_moe(h, topk_w, topk_ids, w13, w2, packed, isa)
    shared, scale = None, None
    if grouped_router(layer.config):
        scale = layer.config.moe_router_topk_scaling_factor or 1.0
        if getattr(layer, "shared_experts", None) is not None and getattr(layer, "use_shared_expert", True):
            shared = shared_expert_partials(layer.shared_experts, h, prof)
    return kernels.add_engine_partials(partials, add_dtype, dtype, scale, shared).reshape(shape)


def shared_expert_partials(module, h, prof) -> list:
    """Each engine rank's partial of the shared experts (GLM-4.5's ``Glm4MoeMLP``, reduce_results
    False: the MoE runner adds it to the routed output before the one all-reduce): its slice of the
    gate and up columns by the engine's GEMM, the SiLU-and-mul the dense MLPs use, its K slice of the
    down projection by the engine's GEMM. The weights are gathered whole over training TP; this
    rank's tokens ``h`` (under SP its sequence shard: each rank's gradient then sums over the TP
    group, else every rank's is the same)."""
    from ...numerics import ACTIVE

    fc1, fc2 = module.linear_fc1, module.linear_fc2
    group = getattr(fc1, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
    replicated = not bool(getattr(module.config, "sequence_parallel", False))
    # whole weights over training TP: fc1 rows [g_0; u_0; g_1; u_1; ...], fc2 (H, I)
    w1 = gather_last_dim(fc1.weight.t(), group, replicated_downstream=replicated).t()
    w2 = gather_last_dim(fc2.weight, group, replicated_downstream=replicated)
    full = unshard(w1.chunk(group_size(group)), "column_gated")  # [gate; up]
    r_total, part = prof.rollout_tp, w2.shape[-1] // prof.rollout_tp
    # the engine ranks' [gate_r; up_r] in one tensor: each rank's slice its own place (its prepacked copy)
    engine_w1 = torch.cat([shard(full, "column_gated", r_total, r) for r in range(r_total)])
    numerics = ACTIVE.current()
    partials = []
    for r in range(r_total):
        a = kernels.engine_linear(h, engine_w1[2 * r * part:2 * (r + 1) * part], source=fc1.weight)
        act = numerics.mlp_activation(a, module.config)
        partials.append(kernels.engine_partial_linear(act, w2[:, r * part:(r + 1) * part], fc2.weight))
    return partials

