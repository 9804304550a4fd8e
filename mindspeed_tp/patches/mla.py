"""Multi-latent attention's shared rope key, whose gradient megatron-core gets wrong under TP.

MLA's rope key (``qk_pos_emb_head_dim`` channels of the kv down projection) is one vector per token
that every head's key repeats. megatron-core gathers it whole on each TP rank, expands it over the
rank's own heads, and in the backward takes only its rank's slice of the gathered columns: the
rope key's gradient is the sum over that rank's heads, not over all of them (Megatron-LM issue #1699).
At TP > 1 the gradient is then wrong in value, and no order of additions can make it the one-device
result.

Here the key entering the core attention passes through an identity whose backward sums the rope
channels' gradient over every head, all TP ranks' heads gathered in head order and folded by the
canonical tree in fp32, cast once. The sum is put on the rank's first head and -0.0 on the others,
so megatron's own sum over the expanded heads (any order) returns it exactly: every TP rank holds
the whole gradient, whichever rank's slice the rope columns fall in, at every TP size the same bits."""
import torch

from .. import compat
from ..numerics import ACTIVE
from ..contract.tree import padded_tree_fold
from ..kernels.collectives import gather_along_rank


class _SharedRopeKeyGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, key, nope: int, group):
        ctx.nope, ctx.group = nope, group
        return key.view_as(key)

    @staticmethod
    def backward(ctx, dkey):
        nope = ctx.nope
        rope = dkey[..., nope:].float().movedim(-2, 0)  # [local heads, ..., rope channels]
        heads = gather_along_rank(rope.contiguous(), ctx.group).flatten(0, 1)  # every head, in order
        total = padded_tree_fold(heads, dim=0).to(dkey.dtype)
        out = dkey.clone()
        out[..., nope:] = -0.0  # x + (-0.0) is x for every x, -0.0 included
        out[..., 0, nope:] = total
        return out, None, None


def shared_rope_key(module, key: torch.Tensor) -> torch.Tensor:
    """``key`` [s, b, local heads, qk_head_dim + qk_pos_emb_head_dim] of an MLA core attention, its
    rope channels' gradient summed over all heads (the identity when nothing needs a gradient)."""
    if not (torch.is_grad_enabled() and key.requires_grad):
        return key
    return _SharedRopeKeyGrad.apply(key, module.config.qk_head_dim, compat.tp_group_of(module))


def get_query_key_value_tensors(original):
    """MLASelfAttention.get_query_key_value_tensors, its result shown to the active strategy (an engine
    that decodes from the normed kv latent, as vLLM's MLA does, needs it at the core attention)."""

    def wrapper(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        ACTIVE.strategy.mla_tensors(self, out)
        return out

    return wrapper
