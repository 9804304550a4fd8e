"""Adapter of megatron's MLP.forward (dense layers and shared experts): fc1, the active strategy's
activation, fc2, as megatron's unfused path computes them.

Megatron's ``glu`` applies ``activation_func`` to a ``torch.chunk`` view of fc1's output; ATen's CPU
loop computes the last elements of each row of that view with other code than the rest, so the
bits of an element depended on the shard width. The strategy's activation (``mlp_activation``:
megatron's unfused glu of F.silu or quick_gelu, clamped and offset where the config says, by
``kernels/elementwise.py``) computes every element one way. The settings megatron's other paths
need (fused or Transformer Engine activations, other activations) are refused at the model's
construction (``contract/model_config.py``)."""
import inspect

from ..contract.refusals import refuse
from ..numerics import ACTIVE
from ..patching import PatchRegistry

# MLP.forward's parameters this adapter computes as megatron does; megatron's **kwargs it ignores,
# as megatron does. A parameter a newer megatron-core names in its signature is refused.
_HONOURED = ("hidden_states", "per_token_scale")


def mlp_forward(original):
    named = [p for p, v in inspect.signature(original).parameters.items()
             if v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL) and p != "self"]
    unknown = [p for p in named if p not in _HONOURED]

    def forward(self, hidden_states, *args, **kwargs):
        numerics = ACTIVE.current()
        if numerics is None:
            return original(self, hidden_states, *args, **kwargs)
        if len(args) > 1:
            raise refuse("mlp_forward_argument", argument=f"positional argument {len(args) + 1}")
        per_token_scale = args[0] if args else kwargs.pop("per_token_scale", None)
        for name in unknown:
            if kwargs.get(name) is not None:
                raise refuse("mlp_forward_argument", argument=name)
        if per_token_scale is not None and self.linear_fc2.bias is not None:
            # megatron scales fc2's skipped bias by it; the strategies add a row-parallel bias themselves
            raise refuse("mlp_forward_argument", argument="per_token_scale with a linear_fc2 bias")
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:  # fc1 skips its bias: added here, as megatron's unfused path does
            intermediate = numerics.add_bias(intermediate, bias, sequence_split=False)
        intermediate = numerics.mlp_activation(intermediate, self.config)
        if per_token_scale is not None:
            dtype = intermediate.dtype
            intermediate = (intermediate * per_token_scale.unsqueeze(-1)).to(dtype)
        return self.linear_fc2(intermediate)

    return forward


def register(reg: PatchRegistry) -> None:
    reg.register(
        "megatron.core.transformer.mlp:MLP.forward",
        "fc1, the gated activation (SwiGLU, gpt-oss' clamped quick-GEGLU) with every element computed by one code "
        "path (kernels/elementwise.py), fc2: megatron's unfused MLP, whose activation on a torch.chunk view gave "
        "other bits at a row's tail",
        wraps=True,
    )(mlp_forward)
