"""The MoE layer in one fixed order (the canonical-tree and rollout-layout strategies).

The layer's own router weights, experts and shared experts are used; what changes is the
arithmetic and the data movement around them:
- router logits by the batch-invariant GEMM in fp32 (plus the router's bias, gpt-oss), top-k with ties
  to the lower expert id;
- each token slot's row goes only to the ranks holding its expert (selected-row all-to-all over
  the expert tensor-and-model-parallel group, ``kernels/moe_dispatch.py``); each rank runs its
  local experts on their rows in the order of the all-gathered tokens, by the batch-invariant
  GEMM, the fc2 across expert TP as the strategy reduces it (``expert_down_proj``: the canonical
  tree, or the engine's partials);
- expert outputs move back to the token's rank by the reverse all-to-all (one owner rank per
  expert, never summed), and a token's k outputs are summed in fp32 in slot order, cast once,
  then the shared expert's output is added.
The dispatcher type (allgather or alltoall) therefore no longer changes any value.
"""
import torch

from ...kernels import moe_dispatch
from ...kernels.collectives import gather_along_rank, group_rank
from ...kernels.moe import combine_slots, route


def _groups():
    from megatron.core import parallel_state as ps

    return (
        ps.get_expert_tensor_and_model_parallel_group(),
        ps.get_expert_tensor_parallel_group(),
        ps.get_expert_model_parallel_rank(),
    )


def _experts_forward(numerics, experts, inputs, etp_group, config, rows) -> list:
    """The local expert MLPs on their rows: the strategy's fc1 shards, activation, the strategy's fc2
    across expert TP (all experts' at once, for strategies that compute them together), each with its
    bias where the model has them (``rows``: the strategy's record of where each expert's rows come
    from, or None). The routing weight multiplies the whole output, fc2's bias included, at the
    combine: megatron's experts scale fc2's bias by it too."""
    fc1s = [e.linear_fc1 for e in experts]
    ups = numerics.expert_up_projs(inputs, [f.weight for f in fc1s], [f.bias for f in fc1s], etp_group,
                                   config.gated_linear_unit, rows)
    acts = [numerics.mlp_activation(a, config) for a in ups]
    fc2s = [e.linear_fc2 for e in experts]
    return numerics.expert_down_projs(acts, [f.weight for f in fc2s], [f.bias for f in fc2s], etp_group,
                                      [x.dtype for x in inputs], rows)


def _run_forward_pre_hooks(module) -> None:
    """What calling ``module`` runs before its forward: its forward pre-hooks. The patch reads the
    router's and the experts' weights without calling those modules, so it runs their hooks itself:
    DDP's hook waits for the parameter all-gather (overlap_param_gather) and dispatches the next
    bucket's; skipping it leaves the gather unwaited and breaks DDP's dispatch chain."""
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in getattr(module, "_forward_pre_hooks_with_kwargs", {}):
            hook(module, (), {})
        else:
            hook(module, ())


def _router_losses_enabled(router, config) -> bool:
    """megatron's router adds a loss (load balancing or z-loss) in this forward."""
    if not (router.training and torch.is_grad_enabled()):
        return False
    z = getattr(config, "moe_z_loss_coeff", None)
    coeff = getattr(config, "moe_aux_loss_coeff", 0.0) or 0.0
    aux = any(c > 0 for c in coeff) if isinstance(coeff, (list, tuple)) else coeff > 0
    balancing = getattr(config, "moe_router_load_balancing_type", "none")
    types = balancing if isinstance(balancing, (list, tuple)) else [balancing]
    return bool(z) or (aux and any(t != "none" for t in types))


def _attach_router_losses(numerics, router, logits, probs, seq_length, padding_mask):
    """megatron's own router losses on our (bitwise) router logits: ``router.routing`` computes the
    z-loss, aux_loss / seq_aux_loss / global_aux_loss exactly as vanilla does and attaches each to
    the probabilities it returns (MoEAuxLossAutoScaler: identity forward, the loss's gradient in
    backward). Adding those probabilities times zero to ours changes no value and routes the losses'
    gradients into the router through megatron's code. Its routing decision is not used (ours is the
    layout-invariant one); it also keeps the expert-bias statistics (from the same logits)."""
    theirs = numerics.router_losses(router, logits.view(seq_length, -1, logits.shape[-1]), padding_mask)
    return probs + theirs.sum() * 0.0


def canonical_moe(numerics, layer, hidden_states, padding_mask, publish_routing):
    """MoELayer.forward's output under ``numerics`` (padding_mask [s, b], True at padding: excluded
    from the router's losses and expert-bias statistics, as in megatron)."""
    config = layer.config
    shape, dtype = hidden_states.shape, hidden_states.dtype
    h = hidden_states.reshape(-1, shape[-1])
    router = layer.router
    _run_forward_pre_hooks(router)
    for expert in layer.experts.local_experts:
        _run_forward_pre_hooks(expert.linear_fc1)
        _run_forward_pre_hooks(expert.linear_fc2)
    num_experts = config.num_moe_experts
    expert_bias = getattr(router, "expert_bias", None) if getattr(router, "enable_expert_bias", False) else None
    logits = numerics.router_logits(h, router.weight, getattr(router, "bias", None), config)
    idx, probs = route(
        logits, config.moe_router_topk, getattr(config, "moe_router_score_function", "softmax"),
        bool(getattr(config, "moe_router_pre_softmax", False)), expert_bias,
        getattr(config, "moe_router_topk_scaling_factor", None), getattr(config, "moe_router_num_groups", None),
        getattr(config, "moe_router_group_topk", None),
    )
    publish_routing(layer, idx)
    if _router_losses_enabled(router, config):
        probs = _attach_router_losses(numerics, router, logits, probs, shape[0], padding_mask)
    elif expert_bias is not None and torch.is_grad_enabled():
        with torch.no_grad():  # the bias update statistics Megatron keeps (padding tokens excluded)
            chosen = idx if padding_mask is None else idx[~padding_mask.reshape(-1)]
            router.local_tokens_per_expert += torch.bincount(chosen.reshape(-1), minlength=num_experts).to(
                router.local_tokens_per_expert.dtype)

    tp_ep, etp_group, ep_rank = _groups()
    n_local, k = idx.shape
    experts = layer.experts.local_experts
    num_local = len(experts)
    ep_of_position = gather_along_rank(idx.new_tensor([ep_rank]), tp_ep).reshape(-1)
    plan = moe_dispatch.plan(idx, ep_of_position, group_rank(tp_ep), num_experts, num_local, tp_ep)
    inputs = numerics.moe_dispatch(h, plan, tp_ep, k)
    rows = numerics.expert_rows(plan, tp_ep, experts)
    # Also an expert no token chose runs (on zero rows), as megatron's experts do: its weights get
    # a (zero) gradient, so DDP's per-bucket gradient-ready count completes (overlap_grad_reduce).
    outputs = _experts_forward(numerics, experts, inputs, etp_group, config, rows)
    mine = moe_dispatch.combine(outputs, plan, tp_ep, n_local, k)
    output = combine_slots(mine, probs).to(dtype).reshape(shape)
    shared = getattr(layer, "shared_experts", None)
    if shared is not None and getattr(layer, "use_shared_expert", True):
        output = output + shared(hidden_states)
    return output
