"""Adapter of megatron.core MoELayer: megatron's arguments and the layer's settings checked, then
the active strategy's MoE (by default routing, dispatch, experts and combine in one fixed order,
``numerics/canonical/moe_layer.py``); routing decisions are published to observers (the checker's bisect)."""
from ..contract import refusals
from ..contract.model_config import check_router_dtype
from ..contract.refusals import refuse
from ..numerics import ACTIVE
from ..patching import PatchRegistry


def check_moe_config(config) -> None:
    """Reject every MoE setting whose result depends on the layout, naming it."""
    refusals.check_config(refusals.MOE, config)
    check_router_dtype(config)
    ACTIVE.strategy.check_moe_config(config)


# Callables (layer, expert indices (tokens, k)) told of every routing decision (the checker's
# bisect records them); empty unless someone observes.
_routing_observers: list = []


def add_routing_observer(observer) -> None:
    _routing_observers.append(observer)


def remove_routing_observer(observer) -> None:
    if observer in _routing_observers:
        _routing_observers.remove(observer)


def _publish_routing(layer, idx) -> None:
    for observer in _routing_observers:
        observer(layer, idx)


def moe_forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
    """MoELayer.forward (0.12: ``(hidden_states)``; 0.16 also ``intermediate_tensors``, CUDA-graph
    partial execution, refused; ``padding_mask`` [b, s], True at padding: excluded from the router's
    losses and expert-bias statistics, as in megatron)."""
    if intermediate_tensors is not None or getattr(self, "fwd_execution_map", None) not in (
            None, ["route", "expert_compute", "postprocess"]):
        raise refuse("moe_partial_forward")
    if getattr(self, "moe_layer_recompute", False):
        raise refuse("moe_layer_recompute")
    if getattr(getattr(self, "router", None), "router_replay", None) is not None:
        raise refuse("moe_router_replay")  # verl's R2 / R3 replay patches a routing the strategy never calls
    if padding_mask is not None:
        padding_mask = padding_mask.transpose(0, 1).bool()  # [s, b], as hidden_states (megatron does the same)
    return ACTIVE.strategy.moe(self, hidden_states, padding_mask, _publish_routing), None


def moe_layer_init(original):
    def __init__(self, config, *args, **kwargs):
        check_moe_config(config)
        original(self, config, *args, **kwargs)

    return __init__


def register(reg: PatchRegistry) -> None:
    target = "megatron.core.transformer.moe.moe_layer:MoELayer"
    reg.register(
        f"{target}.forward",
        "MoE by the active strategy (by default in one fixed order: fp32 router, lowest-id tie-break, rows "
        "gathered/returned by data movement, batch-invariant experts, expert-TP fc2 by the canonical tree, fp32 "
        "slot-order combine)",
    )(moe_forward)
    reg.register(
        f"{target}.__init__", "rejects capacity factors and other layout-dependent MoE settings at build time",
        wraps=True,
    )(moe_layer_init)
