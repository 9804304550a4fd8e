"""Checkpoints that keep an MoE layer's experts stacked in a few tensors, seen as per-expert Linear
tensors so that the one tensor map (``hf/mapping.py``) reads and writes them.

gpt-oss keeps ``mlp.experts.gate_up_proj`` [E, H, 2I] (``x @ W`` orientation, gate and up interleaved
along the last dim: gate, up, gate, up, ...), ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H] and
``down_proj_bias`` [E, H]. Seen here as ``mlp.experts.{e}.gate_proj.weight`` [I, H] (the transpose of
the even columns of expert e's slab), ``up_proj.weight`` (the odd ones), ``down_proj.weight`` [H, I] and
their biases. A family declares its stacks (``STACKED_EXPERTS``); loading reads one expert's slab at a
time; export (``stack``) writes the stacked tensors back. (``Stack``, a family's declaration, is in
``families/common.py``.)"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..errors import ConfigError
from ..families.common import Stack

_LAYER = "model.layers.{i}."


def _virtual_names(stacks, num_layers: int, num_experts: int):
    """virtual name -> (stacked name, expert, part index, stack) for every layer and expert."""
    out = {}
    for i in range(num_layers):
        layer = _LAYER.format(i=i)
        for st in stacks:
            for e in range(num_experts):
                for j, part in enumerate(st.parts):
                    out[layer + st.expert.format(e=e) + part] = (layer + st.stacked, e, j, st)
    return out


def _part(slab: torch.Tensor, j: int, st: Stack) -> torch.Tensor:
    n = len(st.parts)
    part = slab[..., j::n] if n > 1 else slab
    return (part.t() if st.transposed else part).contiguous()


class StackedExpertsView:
    """A checkpoint (``hf.checkpoint.SafetensorsCheckpoint``) whose stacked expert tensors read as
    per-expert ones; every other tensor reads through."""

    def __init__(self, checkpoint, stacks: Tuple[Stack, ...], num_layers: int, num_experts: int):
        self.checkpoint, self.directory = checkpoint, checkpoint.directory
        real = set(checkpoint.names())
        self._virtual = {name: source for name, source in _virtual_names(stacks, num_layers, num_experts).items()
                         if source[0] in real}
        self._stacked = {source[0] for source in self._virtual.values()}
        self._slab: Optional[Tuple[str, int, torch.Tensor]] = None  # the last slab read

    @property
    def digest(self) -> str:
        return self.checkpoint.digest

    def names(self) -> List[str]:
        return sorted([n for n in self.checkpoint.names() if n not in self._stacked] + list(self._virtual))

    def shape(self, name: str) -> Tuple[int, ...]:
        if name not in self._virtual:
            return self.checkpoint.shape(name)
        stacked, _, _, st = self._virtual[name]
        shape = list(self.checkpoint.shape(stacked)[1:])
        if shape[-1] % len(st.parts):
            raise ConfigError(f"{self.directory}: {stacked}'s last dim {shape[-1]} does not hold {len(st.parts)} "
                              f"interleaved parts")
        shape[-1] //= len(st.parts)
        return tuple(reversed(shape)) if st.transposed else tuple(shape)

    def read(self, name: str, rows: Optional[Tuple[int, int]] = None,
             cols: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        if name not in self._virtual:
            return self.checkpoint.read(name, rows, cols)
        stacked, e, j, st = self._virtual[name]
        if self._slab is None or self._slab[:2] != (stacked, e):  # gate and up come from one slab
            self._slab = (stacked, e, self.checkpoint.read(stacked, (e, e + 1))[0])
        part = _part(self._slab[2], j, st)
        if rows is not None:
            part = part[rows[0]:rows[1]]
        if cols is not None:
            part = part[:, cols[0]:cols[1]]
        return part


def stack(tensors: Dict[str, torch.Tensor], stacks: Tuple[Stack, ...], num_layers: int,
          num_experts: int) -> Dict[str, torch.Tensor]:
    """Export: the per-expert tensors of ``tensors`` written back into their stacked tensors."""
    out = dict(tensors)
    groups: Dict[str, Dict[Tuple[int, int], torch.Tensor]] = {}
    kinds = {}
    for name, (stacked, e, j, st) in _virtual_names(stacks, num_layers, num_experts).items():
        if name in out:
            groups.setdefault(stacked, {})[(e, j)] = out.pop(name)
            kinds[stacked] = st
    for stacked, parts in groups.items():
        st = kinds[stacked]
        n = len(st.parts)
        slabs = []
        for e in range(num_experts):
            pieces = [parts[(e, j)].t() if st.transposed else parts[(e, j)] for j in range(n)]
            # interleave along the last dim: column c of part j is column c * n + j of the slab
            slabs.append(torch.stack(pieces, dim=-1).flatten(-2) if n > 1 else pieces[0])
        out[stacked] = torch.stack(slabs).contiguous()
    return out


def family_stacks(spec) -> Tuple[Stack, ...]:
    """The stacked expert tensors of ``spec``'s family's checkpoints (none for most families)."""
    from ..families import FAMILIES

    return tuple(getattr(FAMILIES[spec.family], "STACKED_EXPERTS", ())) if spec.is_moe else ()


def per_expert_view(checkpoint, spec):
    """``checkpoint`` with its family's stacked experts read per expert (itself where there are none)."""
    stacks = family_stacks(spec)
    return StackedExpertsView(checkpoint, stacks, spec.num_layers, spec.num_experts) if stacks else checkpoint


def in_family_layout(tensors: Dict[str, torch.Tensor], spec) -> Dict[str, torch.Tensor]:
    """Export: per-expert tensors stacked as the family's checkpoints keep them."""
    stacks = family_stacks(spec)
    return stack(tensors, stacks, spec.num_layers, spec.num_experts) if stacks else tensors
