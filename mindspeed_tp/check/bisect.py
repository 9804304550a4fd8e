"""``--bisect``: find the first module whose output differs between two runs, and why.

Forward hooks on the megatron-core modules of a rank's pipeline stage record each module's input and
output hidden states. After the forward every module's tensors are reassembled to their full
single-device shape (sequence-parallel shards gathered along the sequence, tensor-parallel shards
along heads/columns, each pipeline stage's layers from the stage that holds them) and sent to rank 0
in a token-major layout ``(batch, seq, features)``, so two runs are aligned by module name and token.
Router decisions come from the MoE routing capture, the final logprobs from the harness.

The comparison walks the modules in execution order. The first one whose output differs on a real
token is the divergence point; it is classed

- ``kernel``: its inputs are bitwise equal in both runs, its output is not;
- ``framework``: its inputs already differ (the difference entered between recorded modules: a
  residual add, a collective, a cast or a pipeline transfer), or it is a router whose expert
  choices differ.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..kernels.collectives import gather_along_rank
from .metrics import tensor_digest
from .reference import save_reference

# (module name suffix, how the input is sharded over TP, how the output is sharded over TP)
# seq: along the sequence with SP (replicated without); col: along the last dim;
# heads: along the heads dim of [s, b, heads, head_dim]; gated: [gate | up] halves per rank.
_LAYER_MODULES = [
    ("input_layernorm", "seq", "seq"),
    ("self_attention.linear_qkv", "seq", "col"),
    ("self_attention.q_layernorm", "heads", "heads"),
    ("self_attention.k_layernorm", "heads", "heads"),
    ("self_attention.core_attention", "heads", "col"),
    ("self_attention.linear_proj", "col", "seq"),
    ("self_attention", "seq", "seq"),
    ("pre_mlp_layernorm", "seq", "seq"),
    ("mlp.linear_fc1", "seq", "gated"),
    ("mlp.linear_fc2", "col", "seq"),
    ("mlp.router", None, None),  # expert choices per token, filled from the routing capture
    ("mlp", "seq", "seq"),
    ("", "seq", "seq"),  # the transformer layer itself
]
_DTYPE_CODES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64]
ModuleTensors = Dict[str, Tuple[Optional[torch.Tensor], torch.Tensor]]  # name -> (input, output)


def module_order(num_layers: int) -> List[Tuple[str, Optional[str], Optional[str]]]:
    """Every recordable module, in execution order, with its TP shardings."""
    out = [("embedding", None, "seq")]
    for i in range(num_layers):
        for suffix, ins, outs in _LAYER_MODULES:
            out.append((f"decoder.layers.{i}" + (f".{suffix}" if suffix else ""), ins, outs))
    out += [("decoder.final_layernorm", "seq", "seq"), ("output_layer", "seq", "col"), ("logprob", None, None)]
    return out


def layer_of(name: str) -> Optional[int]:
    m = re.match(r"decoder\.layers\.(\d+)", name)
    return int(m.group(1)) if m else None


def global_module_name(model, local_name: str) -> str:
    """decoder.layers.<local> renumbered to the global layer index (PP stages number from 0)."""
    parts = local_name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


class ModuleRecorder:
    """Forward hooks recording (input, output) of this stage's modules under their global names."""

    def __init__(self, model, num_layers: int):
        # router decisions come from the routing capture, logprobs from the harness
        wanted = {name for name, _, _ in module_order(num_layers)
                  if not name.endswith(".mlp.router") and name != "logprob"}
        self.captured: Dict[str, Tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        self.handles = []
        for local_name, module in model.named_modules():
            name = global_module_name(model, local_name)
            if name in wanted:
                self.handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))

    def _hook(self, name):
        def hook(module, args, kwargs, output):
            out = _first_tensor(output)
            if out is None:
                return
            inp = _first_tensor(args) if args else None
            if inp is None:
                inp = next((v for k, v in kwargs.items() if k in ("hidden_states", "query", "input")
                            and isinstance(v, torch.Tensor)), None)
            if name == "embedding":
                inp = None  # token ids: the checker verifies them on every rank before the run
            self.captured[name] = (None if inp is None else inp.detach().clone(), out.detach().clone())

        return hook

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def _gather_tp(x: torch.Tensor, kind: Optional[str], layout, group) -> torch.Tensor:
    """This TP rank's shard -> the full tensor (only the TP group takes part)."""

    if layout.tp == 1 or kind is None or (kind == "seq" and not layout.sp):
        return x
    parts = list(gather_along_rank(x.contiguous(), group).unbind(0))
    if kind == "seq":
        return torch.cat(parts, dim=0)
    if kind == "heads":
        return torch.cat(parts, dim=2)
    if kind == "gated":
        halves = [p.chunk(2, dim=-1) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=-1)
    return torch.cat(parts, dim=-1)


def _token_major(x: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """[s, b, ...] (Megatron's order) -> (b, s, features)."""
    return x.transpose(0, 1).reshape(b, s, -1).contiguous()


def _send_to_rank0(x: Optional[torch.Tensor], owner: int) -> Optional[torch.Tensor]:
    rank = dist.get_rank()
    if owner == 0:
        return x if rank == 0 else None
    if rank == owner:
        header = torch.zeros(10, dtype=torch.int64)
        header[0], header[1] = x.dim(), _DTYPE_CODES.index(x.dtype)
        header[2 : 2 + x.dim()] = torch.tensor(x.shape)
        dist.send(header, dst=0)
        dist.send(x.contiguous(), dst=0)
        return None
    if rank == 0:
        header = torch.empty(10, dtype=torch.int64)
        dist.recv(header, src=owner)
        ndim, code = int(header[0]), int(header[1])
        out = torch.empty(tuple(int(d) for d in header[2 : 2 + ndim]), dtype=_DTYPE_CODES[code])
        dist.recv(out, src=owner)
        return out
    return None


def collect(recorder: Optional[ModuleRecorder], layout, num_layers: int, batch, logprobs: torch.Tensor,
            routing: Optional[torch.Tensor], moe_layers: List[int]) -> ModuleTensors:
    """Every module's full (input, output), token-major, on rank 0 ({} on the other ranks).
    Every rank of the world calls this after the layout's forward."""
    from megatron.core import parallel_state

    b, s = batch.tokens.shape
    captured = recorder.captured if recorder is not None else {}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    order = module_order(num_layers)
    full: Dict[Tuple[str, int], torch.Tensor] = {}
    for name, in_kind, out_kind in order:  # the same names in the same order on every rank of a TP group
        if name not in captured:
            continue
        inp, out = captured[name]
        if inp is not None:
            full[(name, 0)] = _token_major(_gather_tp(inp, in_kind, layout, tp_group), b, s)
        full[(name, 1)] = _token_major(_gather_tp(out, out_kind, layout, tp_group), b, s)
    world = dist.get_world_size()
    slots = [(name, io) for name, _, _ in order for io in (0, 1)]
    owners = torch.tensor([world - dist.get_rank() if tp_rank == 0 and key in full else 0 for key in slots])
    dist.all_reduce(owners, op=dist.ReduceOp.MAX)  # the lowest rank holding each tensor sends it
    result: ModuleTensors = {}
    for (name, io), owner in zip(slots, owners.tolist()):
        if owner == 0:
            continue
        t = _send_to_rank0(full.get((name, io)), world - owner)
        if t is not None:
            inp, out = result.get(name, (None, None))
            result[name] = (t, out) if io == 0 else (inp, t)
    if dist.get_rank() != 0:
        return {}
    ordered: ModuleTensors = {}
    for name, _, _ in order:
        if name.endswith(".mlp.router") and routing is not None and layer_of(name) in moe_layers:
            pre = result.get(name.replace(".mlp.router", ".pre_mlp_layernorm"), (None, None))[1]
            choices = routing[layer_of(name)].reshape(s, b, -1)
            ordered[name] = (pre, _token_major(choices, b, s))
        elif name == "logprob":
            head = result.get("output_layer", (None, None))[1]
            ordered[name] = (head, logprobs.float().reshape(b, s, 1).contiguous())
        elif name in result and result[name][1] is not None:
            ordered[name] = result[name]
    return ordered


# -- comparison ----------------------------------------------------------------------------------

def _token_differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(batch, seq) bool: any raw bit of the token's features differs."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return torch.ones(a.shape[:2], dtype=torch.bool)
    return (a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).any(dim=-1)


def _nonfinite(x: torch.Tensor, mask: torch.Tensor):
    if not x.is_floating_point():
        return 0, None
    bad = (~torch.isfinite(x)).any(dim=-1) & mask
    count = int((~torch.isfinite(x))[mask].sum())
    first = torch.nonzero(bad)
    return count, (first[0].tolist() if len(first) else None)


def compare_modules(test: ModuleTensors, ref: ModuleTensors, real: torch.Tensor, scored: torch.Tensor) -> Dict:
    """Per-module comparison of two runs and the first divergence, as JSON-ready data.

    real: (b, s) positions holding real tokens; scored: the positions whose logprob is compared."""
    modules = []
    for name in ref:
        if name not in test:
            continue
        (ti, to), (ri, ro) = test[name], ref[name]
        mask = scored if name == "logprob" else real
        differs = _token_differs(to, ro) & mask
        rec = {"module": name, "layer": layer_of(name), "tokens": int(mask.sum()),
               "tokens_differing": int(differs.sum()), "digest": tensor_digest(to), "reference_digest": tensor_digest(ro)}
        if to.shape == ro.shape and to.is_floating_point():
            both = torch.isfinite(to) & torch.isfinite(ro) & mask.unsqueeze(-1)
            d = (to.double() - ro.double()).abs()[both]
            rec["max_abs_diff"] = float(d.max()) if d.numel() else 0.0
        else:
            rec["max_abs_diff"] = float("nan") if to.shape != ro.shape else float(differs.any())
        rec["nonfinite_values"], rec["first_nonfinite"] = _nonfinite(to, mask)
        first = torch.nonzero(differs)
        rec["first_token"] = first[0].tolist() if len(first) else None
        rec["differing_tokens_sample"] = [p.tolist() for p in first[:8]]
        rec["inputs_equal"] = (None if ti is None or ri is None
                               else not bool((_token_differs(ti, ri) & real).any()))
        modules.append(rec)
    first = next((m for m in modules if m["tokens_differing"]), None)
    summary = {"modules": modules, "first_divergence": None,
               "layers_affected": sorted({m["layer"] for m in modules if m["tokens_differing"] and m["layer"] is not None}),
               "routing_differs_layers": [m["layer"] for m in modules
                                          if m["module"].endswith(".mlp.router") and m["tokens_differing"]]}
    lp = next((m for m in modules if m["module"] == "logprob"), None)
    summary["logprob_tokens_differing"] = lp["tokens_differing"] if lp else None
    if first is not None:
        if first["module"].endswith(".mlp.router"):
            kind, why = "framework", "routing decisions differ: the tokens chose different experts"
        elif first["inputs_equal"] is False:
            kind, why = "framework", ("its inputs already differ: the difference entered between recorded modules "
                                      "(a residual add, a collective, a cast or a pipeline transfer)")
        else:
            kind, why = "kernel", "same inputs, different output"
        summary["first_divergence"] = {
            "module": first["module"], "layer": first["layer"], "classification": kind, "reason": why,
            "tokens_differing": first["tokens_differing"], "tokens": first["tokens"],
            "first_token": first["first_token"], "max_abs_diff": first["max_abs_diff"],
        }
    return summary


def format_bisect(summary: Dict, title: str, max_rows: int = 8) -> str:
    first = summary["first_divergence"]
    if first is None:
        return f"bisect {title}: every recorded module output is bitwise equal ({len(summary['modules'])} modules)"
    b, s = first["first_token"]
    lines = [
        f"bisect {title}: first divergence at {first['module']}"
        + (f" (layer {first['layer']})" if first["layer"] is not None else ""),
        f"  classification: {first['classification']} ({first['reason']})",
        f"  tokens differing: {first['tokens_differing']}/{first['tokens']} (first at batch {b}, position {s}), "
        f"max|diff| {first['max_abs_diff']:.3g}",
        f"  layers affected: {', '.join(map(str, summary['layers_affected'])) or 'none'}"
        + (f"; routing differs in layers {summary['routing_differs_layers']}" if summary["routing_differs_layers"] else "")
        + (f"; logprob differs at {summary['logprob_tokens_differing']} scored tokens"
           if summary["logprob_tokens_differing"] is not None else ""),
        f"  {'module':<48}{'tokens!=':>10}{'max|diff|':>12}  inputs",
    ]
    start = next(i for i, m in enumerate(summary["modules"]) if m["module"] == first["module"])
    for m in summary["modules"][start : start + max_rows]:
        inputs = {None: "-", True: "equal", False: "differ"}[m["inputs_equal"]]
        lines.append(f"  {m['module']:<48}{m['tokens_differing']:>10}{m['max_abs_diff']:>12.3g}  {inputs}")
    return "\n".join(lines)


def dump(path: str, test: ModuleTensors, ref: ModuleTensors, meta: Dict[str, str]) -> None:
    """Both runs' tensors for offline inspection (safetensors, token-major (batch, seq, features))."""

    tensors = {}
    for prefix, run in (("test", test), ("reference", ref)):
        for name, (inp, out) in run.items():
            tensors[f"{prefix}/{name}/output"] = out
            if inp is not None:
                tensors[f"{prefix}/{name}/input"] = inp
    save_reference(path, tensors, meta)


def to_flat(run: ModuleTensors, key: str) -> Dict[str, torch.Tensor]:
    """For the reference file: bisect/<key>/<module>/{input,output}."""
    out = {}
    for name, (inp, o) in run.items():
        out[f"bisect/{key}/{name}/output"] = o
        if inp is not None:
            out[f"bisect/{key}/{name}/input"] = inp
    return out


def from_flat(tensors: Dict[str, torch.Tensor], key: str, num_layers: int) -> ModuleTensors:
    run: ModuleTensors = {}
    for name, _, _ in module_order(num_layers):
        out = tensors.get(f"bisect/{key}/{name}/output")
        if out is not None:
            run[name] = (tensors.get(f"bisect/{key}/{name}/input"), out)
    return run


def bisect_report(test: ModuleTensors, ref: ModuleTensors, batch, dump_dir: Optional[str], run_name: str,
                  meta: Dict[str, str]) -> Dict:
    """compare_modules over the batch's real tokens; with dump_dir, both runs' tensors are saved to
    DIR/<run_name>.safetensors (its path under ``dump``)."""
    report = compare_modules(test, ref, batch.real, batch.scored)
    if dump_dir:
        report["dump"] = os.path.join(dump_dir, f"{run_name}.safetensors")
        dump(report["dump"], test, ref, meta)
    return report
