"""A layout-free training state: every parameter's full logical tensor (TP=1 names and shapes), its
fp32 main copy and Adam's two moments, plus the step count, in one safetensors file.

``save_state`` gathers each rank's TP shards (moved, never summed) and brings every stage's tensors
to rank 0, which writes the file; ``load_state`` gives every rank its shard of each tensor (the
model parameter, the optimizer's main parameter -- a DP rank's range of it under the distributed
optimizer -- and Adam's state), and the routers' expert biases. Expert weights are gathered over
expert TP, each from the EP rank holding it. A job saved in one layout and resumed in another continues
the same trajectory under bitwise training (tests/test_bitwise_training.py::test_a_killed_rank_ends_the_run_and_it_resumes_on_another_layout_with_the_same_bits,
tests/test_bitwise_moe_training.py for MoE).

The file is written atomically (a temporary file in the same directory, fsync, rename) and carries
the SHA-256 of its tensors in its metadata; a file whose tensors do not match it (truncated,
corrupted) is refused by name (``read_state``). ``checkpoints``: a directory of such files, one per
step (``step-000002.safetensors``), the last two kept.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save

from ...errors import ConfigError
from ...kernels.collectives import gather_along_rank
from ...models.weights import full_weight_shapes, global_param_name, is_expert_weight, param_shards, shard, unshard
from .snapshots import leaf_optimizers, main_param_pairs, optimizer_states

KINDS = ("param", "main_param", "exp_avg", "exp_avg_sq")
BUFFER = "buffer"  # the routers' expert biases: state training updates that is no parameter
CHECKPOINT = re.compile(r"^step-(\d{6})\.safetensors$")
KEEP_CHECKPOINTS = 2


def _digest(tensors: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(key.encode())
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _sorted_header(blob: bytes) -> bytes:
    """The safetensors file with its JSON header's keys sorted. safetensors keeps the metadata in a
    hash map, so two writes of the same state could order it differently; the tensor bytes and their
    offsets do not change, and the compact JSON keeps its length (padded as before)."""
    size = int.from_bytes(blob[:8], "little")
    header = json.dumps(json.loads(blob[8:8 + size]), sort_keys=True, separators=(",", ":")).encode()
    if len(header) > size:
        raise RuntimeError("state file: the sorted header is longer than safetensors' own")
    return blob[:8] + header + b" " * (size - len(header)) + blob[8 + size:]


def write_atomically(path: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> None:
    """``path`` appears complete or not at all: a temporary file beside it, fsynced, renamed. The
    same state always gives the same bytes (``_sorted_header``), so two runs compare file to file."""
    blob = _sorted_header(save(tensors, metadata={**metadata, "sha256": _digest(tensors)}))
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def read_state(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(tensors, metadata) of a state file, refused by name when it is unreadable, truncated or
    its tensors do not match the checksum it carries."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
        tensors = load_file(path)
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise ConfigError(f"state file {path} is unreadable (truncated or corrupted?): {type(exc).__name__}: {exc}; "
                          f"nothing was loaded") from exc
    expected = metadata.get("sha256")
    if expected is not None and _digest(tensors) != expected:
        raise ConfigError(f"state file {path} is corrupted: its tensors do not match the checksum it was written "
                          f"with; nothing was loaded")
    return tensors, metadata


def checkpoints(directory: str) -> List[Tuple[int, str]]:
    """(step, path) of the checkpoints in ``directory``, oldest first (temporary files ignored)."""
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, name))
             for name in os.listdir(directory) if (m := CHECKPOINT.match(name))]
    return sorted(found)


def newest_checkpoint(directory: str) -> Tuple[int, str]:
    """The newest checkpoint of ``directory``, verified (a damaged one is refused by name, never
    skipped or removed); ConfigError when there is none."""
    found = checkpoints(directory)
    if not found:
        raise ConfigError(f"--resume {directory}: no checkpoint (step-NNNNNN.safetensors) in it; write them with "
                          f"--checkpoint-dir")
    step, path = found[-1]
    _, metadata = read_state(path)
    if int(metadata.get("steps", -1)) != step:
        raise ConfigError(f"state file {path} says it holds {metadata.get('steps')} steps, its name {step}: "
                          f"corrupted or renamed; nothing was loaded")
    return step, path


def checkpoint_path(directory: str, steps_done: int) -> str:
    return os.path.join(directory, f"step-{steps_done:06d}.safetensors")


def prune_checkpoints(directory: str, keep: int = KEEP_CHECKPOINTS) -> None:
    for _, path in checkpoints(directory)[:-keep]:
        os.remove(path)


def _full_on_this_stage(spec, layout, chunks, optimizer) -> Dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    states = optimizer_states(optimizer, chunks)
    tp_group = ps.get_tensor_model_parallel_group()
    etp_group = ps.get_expert_tensor_parallel_group() if spec.is_moe else None
    ep_rank = ps.get_expert_model_parallel_rank() if spec.is_moe else 0
    out = {}
    for chunk in chunks:
        for name, p, rule, size, _ in param_shards(chunk, spec, layout):
            group = etp_group if is_expert_weight(name) else tp_group
            values = {"param": p.detach().float(), **{k: states[p][k] for k in KINDS[1:]}}
            for kind, value in values.items():
                parts = gather_along_rank(value.contiguous(), group) if size > 1 else value.unsqueeze(0)
                out[f"{kind}/{name}"] = unshard(list(parts), rule)
        for local_name, buf in chunk.named_buffers():  # the routers' expert biases (updated by training)
            if local_name.endswith("router.expert_bias"):
                out[f"{BUFFER}/{global_param_name(chunk, local_name, ep_rank)}"] = buf.detach().float().clone()
    return out


def save_state(path: str, spec, layout, profile, chunks, optimizer, steps_done: int) -> None:
    mine = _full_on_this_stage(spec, layout, chunks, optimizer)
    shapes = full_weight_shapes(spec, spec.padded_vocab(profile))
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name in sorted(shapes):
        for kind in (BUFFER,) if name.endswith("expert_bias") else KINDS:
            key = f"{kind}/{name}"
            holder = torch.tensor([rank if key in mine else world])
            dist.all_reduce(holder, op=dist.ReduceOp.MIN)
            if int(holder) == world:
                raise RuntimeError(f"--save-state: no rank holds {key}")
            t = mine[key].contiguous() if key in mine else torch.empty(shapes[name], dtype=torch.float32)
            dist.broadcast(t, src=int(holder))
            out[key] = t
    if rank == 0:
        write_atomically(path, out, {"steps": str(steps_done), "model": spec.name})
    dist.barrier()


def load_state(path: str, spec, layout, chunks, optimizer) -> int:
    """Put this rank's shards of the saved state in place; returns the saved step count."""
    from megatron.core import parallel_state as ps

    full, metadata = read_state(path)
    steps = int(metadata.get("steps", "0"))
    by_param = {}
    for chunk in chunks:
        for name, p, rule, size, rank in param_shards(chunk, spec, layout):
            if f"param/{name}" not in full:
                raise ConfigError(f"--load-state {path}: no tensor for {name} (saved from another model?)")
            by_param[p] = {kind: shard(full[f"{kind}/{name}"], rule, size, rank) for kind in KINDS}
            with torch.no_grad():
                p.copy_(by_param[p]["param"].to(p.dtype))
        ep_rank = ps.get_expert_model_parallel_rank() if spec.is_moe else 0
        for local_name, buf in chunk.named_buffers():
            if local_name.endswith("router.expert_bias"):
                key = f"{BUFFER}/{global_param_name(chunk, local_name, ep_rank)}"
                if key not in full:
                    raise ConfigError(f"--load-state {path}: no tensor {key} (saved from another model?)")
                with torch.no_grad():
                    buf.copy_(full[key].to(buf.dtype))
    for opt in leaf_optimizers(optimizer):
        sharded = hasattr(opt, "shard_fp32_from_float16_groups")
        for model_param, main in main_param_pairs(opt):
            values = by_param[model_param]
            rng = opt._get_model_param_range_map(model_param)["param"] if sharded else None

            def pick(t, r=rng):  # this rank's range of the flattened parameter (all of it unsharded)
                return t.reshape(-1) if r is None else t.reshape(-1)[r.start:r.end]

            with torch.no_grad():
                main.view(-1).copy_(pick(values["main_param"]).to(main.dtype))
            opt.optimizer.state[main] = {
                "step": torch.tensor(float(steps)),
                "exp_avg": pick(values["exp_avg"]).clone().view(main.shape).to(main.device),
                "exp_avg_sq": pick(values["exp_avg_sq"]).clone().view(main.shape).to(main.device),
            }
    return steps
