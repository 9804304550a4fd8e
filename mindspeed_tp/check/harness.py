"""``check``'s scoring of one layout: a GPTModel forward through the driver (``check/driver.py``),
per-token logprobs on every rank, and what the report reads besides (MoE routing decisions,
non-finite logits, module outputs for --bisect).

Layouts are run one after another in the same torchrun world (Megatron's parallel state is
rebuilt for each), so the reference TP=PP=1 run and the distributed runs share processes,
thread settings and weights generator.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..contract.profile import Profile
from ..contract.sampling import Sampling
from ..patches import moe as moe_patch
from ..switch import disable, enable
from . import bisect, hooks
from .batch import ScoringBatch, pack_batch
from .context_parallel import cp_state, gather_columns, global_rows, local_columns, place_rows
from .driver import (build_stage, engine_scoring, logprobs_from_logits, pipeline_forward, setup_parallel_state,
                     stage_dtype)
from ..models.layout import Layout
from ..models.spec import ModelSpec


class _RoutingCapture:
    """Collects each MoE layer's chosen experts per local token: from the patched MoE forward
    (consistent mode) or from the TopKRouter's output (vanilla)."""

    def __init__(self, model, vanilla: bool, num_experts: int):
        self.maps = {}
        self.handles = []
        self.num_experts = num_experts
        if vanilla:
            from megatron.core.transformer.moe.router import TopKRouter

            for module in model.modules():
                if isinstance(module, TopKRouter):
                    self.handles.append(module.register_forward_hook(self._hook))
        else:
            moe_patch.add_routing_observer(self._observe)

    def _hook(self, module, args, output):
        self.maps[module.layer_number] = output[1].reshape(-1, output[1].shape[-1]).bool()

    def _observe(self, layer, idx):
        chosen = torch.zeros(idx.shape[0], self.num_experts, dtype=torch.bool, device=idx.device)
        chosen.scatter_(1, idx, True)
        self.maps[getattr(layer, "layer_number", id(layer))] = chosen

    def close(self):
        for h in self.handles:
            h.remove()
        moe_patch.remove_routing_observer(self._observe)


def _full_routing(maps, layout: Layout, spec: ModelSpec, tokens: int, rows=None) -> torch.Tensor:
    """(num_layers, s*b, E) uint8 on every rank: layer l's expert set per token (zeros if dense).
    rows: under CP, each local token's row in the whole batch (the other CP ranks fill the rest)."""
    from megatron.core import parallel_state

    full = torch.zeros(spec.num_layers, tokens, spec.num_experts, dtype=torch.uint8)
    group = parallel_state.get_tensor_model_parallel_group()
    for layer_number, chosen in sorted(maps.items()):
        if layout.sp and layout.tp > 1:
            parts = [torch.empty_like(chosen, dtype=torch.uint8) for _ in range(layout.tp)]
            dist.all_gather(parts, chosen.to(torch.uint8), group=group)
            chosen = torch.cat(parts)
        full[layer_number - 1] = place_rows(chosen.to(torch.uint8).cpu(), rows, tokens)
    dist.all_reduce(full, op=dist.ReduceOp.MAX)  # replicas hold equal maps; absent layers are 0
    return full


def layout_logprobs(
    spec: ModelSpec,
    layout: Layout,
    dtype: torch.dtype,
    profile: Profile,
    seed: int,
    batch: ScoringBatch,
    vanilla: bool,
    dispatcher: str = "alltoall",
    sampling: Optional[Sampling] = None,
    weights=None,
    diagnostics: Optional[dict] = None,
    packed: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(b, s) fp32 logprobs of ``batch`` under ``layout``, identical on every rank afterwards, and
    for MoE models the routing decisions (num_layers, s*b, E) (None for dense models).

    weights: where the parameters come from (default: the seeded weights of ``seed``).
    diagnostics (optional dict) receives ``logits_nonfinite`` (NaN/inf count in the real-vocab
    logits) and ``logits_first_nonfinite`` ([batch, position] or None); with
    ``diagnostics["record_modules"]`` true, ``modules``: every module's full input/output on rank 0
    (see bisect.py). packed: score the sequences packed (thd, see ``batch.pack_batch``); the result
    is unpacked to the padded (b, s) layout."""
    from megatron.core import parallel_state

    hooks.at_point("forward", dist.get_rank())
    record = bool(diagnostics and diagnostics.get("record_modules"))

    if vanilla:
        disable()
    else:
        enable(profile)
    setup_parallel_state(layout, seed)
    # A dense model needs one data-parallel replica; MoE experts span replicas, so all compute.
    computes = spec.is_moe or parallel_state.get_data_parallel_rank() == 0
    result = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    maps, recorder = {}, None
    b, s = batch.tokens.shape
    nonfinite = torch.tensor([0, b * s])  # count, first flat index b*s+pos (b*s: none)
    # Under CP each packed sequence is padded to a multiple of 2*CP*TP, as Megatron's thd CP batch.
    packing = pack_batch(batch, layout.tp * (2 * layout.cp if layout.cp > 1 else 1)) if packed else None
    cp_group, cp_size, cp_rank = cp_state()
    cu = packing.cu_seqlens if packed else None
    length = packing.tokens.shape[1] if packed else s
    columns = local_columns(length, cp_size, cp_rank, cu) if cp_size > 1 else None
    if computes:
        model = build_stage(spec, layout, dtype, profile, seed, dispatcher, weights)
        handles = hooks.before_forward(model, layout, parallel_state.get_tensor_model_parallel_rank())
        capture = _RoutingCapture(model, vanilla, spec.num_experts) if spec.is_moe else None
        recorder = bisect.ModuleRecorder(model, spec.num_layers) if record else None
        try:
            with torch.no_grad(), engine_scoring(profile, vanilla, batch, spec):
                out = pipeline_forward(model, layout, batch, spec.hidden_size, stage_dtype(profile, vanilla, dtype),
                                        packing, columns)
        finally:
            for h in handles:
                h.remove()
            if recorder is not None:
                recorder.close()
            if capture is not None:
                capture.close()
                maps = capture.maps
        if out is not None:
            out = hooks.on_logits(out, layout, parallel_state.get_tensor_model_parallel_rank())
            if parallel_state.get_data_parallel_rank() == 0:
                nonfinite = _count_nonfinite_logits(out, spec.vocab_size, columns, length)
                if packed:  # first packed column -> flat index in the padded (b, s) layout
                    nonfinite[1] = packing.padded_index(int(nonfinite[1]), s, none=b * s)
            targets = packing.targets if packed else (batch.targets if columns is not None else None)
            if columns is not None:
                targets = targets[:, columns]
            with engine_scoring(profile, vanilla, batch, spec):
                result = logprobs_from_logits(out, batch, spec.vocab_size, sampling, targets).float().cpu()
            if columns is not None:  # every CP rank's tokens, back in sequence order
                result = gather_columns(result, length, cp_group, cp_size, cu)
            if packed:
                result = packing.unpack(result, batch.tokens.shape)
    # The owner of the answer: last pipeline stage, TP rank 0, DP rank 0.
    is_src = (
        parallel_state.get_data_parallel_rank() == 0
        and parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    flags = torch.tensor([dist.get_rank() if is_src else -1])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    dist.broadcast(result, src=int(flags.item()))
    routing = None
    if spec.is_moe:
        rows = None if columns is None else (columns if packed else global_rows(columns, b))
        routing = _full_routing(maps, layout, spec, packing.tokens.numel() if packed else batch.tokens.numel(), rows)
        if packed:
            routing = packing.unpack_tokens(routing, b, s)
    if diagnostics is not None:
        count, first = nonfinite[:1].clone(), nonfinite[1:].clone()
        dist.all_reduce(count)  # only the last stage's DP-rank-0 TP ranks contribute, each its vocab slice
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        diagnostics["logits_nonfinite"] = int(count)
        diagnostics["logits_first_nonfinite"] = None if int(first) == b * s else [int(first) // s, int(first) % s]
        if record:
            moe_layers = list(range(spec.first_k_dense, spec.num_layers)) if spec.is_moe else []
            diagnostics["modules"] = bisect.collect(recorder, layout, spec.num_layers, batch, result, routing,
                                                    moe_layers)
    return result, routing


def _count_nonfinite_logits(logits: torch.Tensor, vocab_size: int, columns=None, length=None) -> torch.Tensor:
    """[count, first b*s+pos] of NaN/inf in this rank's real-vocab logit columns (GPTModel returns
    [b, s, v/tp]). Padded vocab columns are excluded: they become -inf on purpose. Under CP
    (``columns`` of a row of ``length``) the position is the token's in the whole sequence."""
    from megatron.core import parallel_state

    b, s, width = logits.shape
    start = parallel_state.get_tensor_model_parallel_rank() * width
    real = logits[..., : max(0, min(width, vocab_size - start))]
    bad = ~torch.isfinite(real)
    per_token = bad.any(dim=-1).reshape(-1)  # (b*s) in batch-major order
    hits = torch.nonzero(per_token)
    if columns is None:
        return torch.tensor([int(bad.sum()), int(hits[0]) if len(hits) else b * s])
    firsts = [int(h) // s * length + int(columns[int(h) % s]) for h in hits[:, 0]]
    return torch.tensor([int(bad.sum()), min(firsts) if firsts else b * length])
