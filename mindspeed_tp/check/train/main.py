"""The training check: K optimizer steps in each layout vs the same steps on one device.

``mindspeed-tp train-check`` launches one torchrun world per world size the layouts need
(tp*cp*pp*dp processes each): first the one-device run (world 1, saved as the reference), then every
other world, which loads it. Every world trains from the same seeded weights on the same global
batch (fixed micro-batch size, so each layout sees the same sequences). Exit codes as ``check``:
0 step-1 loss and in-step logprobs bitwise equal to one device in every layout, 1 not, 2 bad input
or usage, 3 the run crashed.
"""
from __future__ import annotations

import argparse
import os
from typing import Dict, List, NamedTuple, Optional

from ...contract.refusals import refuse
from ...errors import ConfigError
from .state_file import newest_checkpoint
from ...models.layout import Layout, validate_layout
from ...models.spec import ModelSpec, load_model_spec
from ...contract.profile import Profile, load_profile
from ..main import (CheckerParser, add_device_flag, check_device, json_digest, override, require_counts, run_main,
                    verify_same_on_all_ranks)
from ..library_warnings import add_verbose_flag
from ..driver import RECOMPUTE
from ..settings import TrainSettings
from .. import user_config

DEFAULTS = dict(
    model=None, profile="default", layouts="tp2-sp", dtype="bf16", seed=1234, steps=3, micro_batch_size=2,
    global_batch_size=8, seq_length=64, lr=3e-3, distributed_optimizer=False, overlap=False, recompute="none",
    dispatcher="alltoall", bitwise_training=False, json=None, vanilla=False, compare_vanilla=False, timeout=600.0, reference=None,
    save_reference=None, launch_layouts=None, results=None, load_state=None, save_state=None, checkpoint_dir=None,
    resume=None, verbose=False, transformer_config=None, device="cpu",
)


def build_parser(prog: str = "mindspeed-tp train-check") -> argparse.ArgumentParser:
    p = CheckerParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="bundled model name (default tiny-dense) or a model config YAML path")
    p.add_argument("--profile", help="numerics profile: bundled name or YAML path (default: default)")
    p.add_argument("--layouts", help="comma-separated training layouts, e.g. tp2-sp-pp2,tp2-pp2-vpp2,tp1-dp2,"
                                     "tp2-sp-dp2,tp2-sp-ep2,tp2-sp-cp2,cp2-dp2 (tpN ppN vppN dpN epN etpN cpN sp; without dpN, "
                                     "the DP replicas the expert grid needs: tp1-ep4 is tp1-ep4-dp4; default tp2-sp)")
    p.add_argument("--dtype", choices=["fp32", "bf16"])
    p.add_argument("--seed", type=int, help="seed of the weights and of the global batch")
    p.add_argument("--steps", type=int, help="optimizer steps per layout (default 3)")
    p.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch (default 2; fixed in every layout)")
    p.add_argument("--global-batch-size", type=int,
                   help="sequences per optimizer step (default 8; micro-batches = global / (micro * dp))")
    p.add_argument("--seq-length", type=int, help="sequence length (default 64)")
    p.add_argument("--lr", type=float, help="Adam learning rate (default 3e-3)")
    p.add_argument("--distributed-optimizer", action="store_true", default=None,
                   help="megatron's distributed optimizer (use_distributed_optimizer)")
    p.add_argument("--overlap", action="store_true", default=None,
                   help="overlap_grad_reduce, and overlap_param_gather with --distributed-optimizer")
    p.add_argument("--recompute", choices=sorted(RECOMPUTE), help="activation recomputation (default none)")
    p.add_argument("--dispatcher", choices=["alltoall", "allgather"], help="MoE token dispatcher (default alltoall)")
    p.add_argument("--bitwise-training", action="store_true", default=None,
                   help="the profile's bitwise_training: the backward pass and optimizer step in canonical order too; "
                        "the verdict then covers every step's loss, gradients, parameters and optimizer state")
    p.add_argument("--json", help="write the report as JSON to this path")
    p.add_argument("--vanilla", action="store_true", default=None, help="no patches: plain megatron-core")
    p.add_argument("--compare-vanilla", action="store_true", default=None,
                   help="also run plain megatron-core and print it next to mindspeed-tp")
    p.add_argument("--timeout", type=float, help="seconds any collective may wait before the run fails with exit "
                                                 "code 3 (default 600)")
    add_device_flag(p)
    p.add_argument("--reference", help="load the one-device run from this safetensors file (--save-reference)")
    p.add_argument("--save-reference", help="save the one-device run (world of one process) to this file")
    p.add_argument("--save-state", help="write the trained state of the (single) layout in --layouts after the last "
                                        "step: full parameters, fp32 main parameters, Adam moments (safetensors)")
    p.add_argument("--load-state", help="start every run (one device and each layout) from a --save-state file "
                                        "instead of the seeded weights, e.g. saved in another layout")
    p.add_argument("--checkpoint-dir", help="after every step, write the (single) layout's state there as "
                                            "step-NNNNNN.safetensors (--save-state's format, atomic, checksummed); "
                                            "the last two are kept")
    p.add_argument("--resume", help="continue from the newest checkpoint of this directory (any layout may have "
                                    "written it; every run starts from it): --steps stays the total step count")
    user_config.add_argument(p)
    p.add_argument("--launch-layouts", help=argparse.SUPPRESS)  # the launcher: this world's share of --layouts
    p.add_argument("--results", help=argparse.SUPPRESS)         # the launcher: where this world's rows go
    add_verbose_flag(p)
    p.add_argument("--status-file", help=argparse.SUPPRESS)
    return p


def resolve_args(argv: Optional[List[str]]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    merged = override(dict(DEFAULTS), args)
    merged["status_file"] = args.status_file
    ns = argparse.Namespace(**merged)
    require_counts(ns, ("steps", "micro_batch_size", "global_batch_size", "seq_length"))
    if ns.vanilla and ns.compare_vanilla:
        raise ConfigError("--vanilla and --compare-vanilla: pick one")
    if ns.save_state and len(parse_layouts(ns.layouts)) != 1:
        raise ConfigError("--save-state saves one layout's state: name exactly one layout in --layouts")
    if ns.checkpoint_dir and len(parse_layouts(ns.layouts)) != 1:
        raise ConfigError("--checkpoint-dir checkpoints one layout's run: name exactly one layout in --layouts")
    if ns.checkpoint_dir and not os.path.isdir(ns.checkpoint_dir):
        raise ConfigError(f"--checkpoint-dir {ns.checkpoint_dir}: no such directory")
    ns.transformer_fields = user_config.load(ns.transformer_config)
    ns.steps_done = 0
    if ns.resume:
        if ns.load_state:
            raise ConfigError("--resume and --load-state both name a starting state: pick one")
        ns.steps_done, ns.load_state = newest_checkpoint(ns.resume)
        if ns.steps_done >= int(ns.steps):
            raise ConfigError(f"--resume {ns.resume}: its newest checkpoint holds {ns.steps_done} steps, --steps "
                              f"{ns.steps} (the total) leaves none to run")
    return ns


class Plan(NamedTuple):
    spec: ModelSpec
    profile: Profile
    layouts: List[Layout]
    modes: List[bool]
    settings: TrainSettings


def parse_layouts(text: Optional[str]) -> List[Layout]:
    """The --layouts entries (Layout.parse_training: the DP an expert grid needs where none is named)."""
    return [Layout.parse_training(entry) for entry in str(text or "").split(",") if entry.strip()]


def plan(ns: argparse.Namespace) -> Plan:
    """Static validation of model, profile, layouts and batch sizes."""
    check_device(ns)
    profile = load_profile(ns.profile)
    if ns.bitwise_training and not profile.bitwise_training:
        profile = profile.replace(bitwise_training=True)
    spec = load_model_spec(ns.model or "tiny-dense")
    layouts = parse_layouts(ns.layouts)
    if not layouts:
        raise ConfigError("--layouts is empty; name at least one layout, e.g. tp2-sp")
    settings = TrainSettings(
        steps=int(ns.steps) - int(getattr(ns, "steps_done", 0)),  # --resume: the steps still to run
        micro_batch_size=int(ns.micro_batch_size), global_batch_size=int(ns.global_batch_size),
        seq_length=int(ns.seq_length), lr=float(ns.lr), distributed_optimizer=bool(ns.distributed_optimizer),
        overlap=bool(ns.overlap), recompute=ns.recompute, dispatcher=ns.dispatcher, seed=int(ns.seed))
    for layout in [Layout()] + layouts:
        validate_layout(layout, spec, profile, settings.seq_length, training=True)
        if settings.global_batch_size % (settings.micro_batch_size * layout.dp):
            raise refuse("train_batch_indivisible", global_batch=settings.global_batch_size,
                         micro=settings.micro_batch_size, dp=layout.dp, layout=layout.name)
        if layout.vpp > 1 and (settings.global_batch_size // (settings.micro_batch_size * layout.dp)) % layout.pp:
            raise refuse("interleaved_microbatches", layout=layout.name, pp=layout.pp)
        if layout.cp > 1 and (ns.vanilla or ns.compare_vanilla) and \
                settings.global_batch_size % (settings.micro_batch_size * layout.dp * layout.cp):
            raise refuse("train_batch_indivisible", global_batch=settings.global_batch_size,
                         micro=settings.micro_batch_size, dp=layout.dp * layout.cp, layout=layout.cp_as_dp().name)
    if settings.seq_length > spec.max_position_embeddings:
        raise ConfigError(f"--seq-length={settings.seq_length} exceeds max_position_embeddings="
                          f"{spec.max_position_embeddings}")
    _check_user_config(ns, spec, layouts, profile, settings)
    modes = [True] if ns.vanilla else ([True, False] if ns.compare_vanilla else [False])
    return Plan(spec, profile, layouts, modes, settings)


def _check_user_config(ns, spec, layouts, profile, settings) -> None:
    """The user's fields over each layout's training config (recompute and per-token loss included)."""
    if not ns.transformer_fields:
        return
    from ...contract.model_config import check_model_config
    from ..builder import DTYPES, transformer_config
    from ..driver import RECOMPUTE

    for layout in layouts:
        config = transformer_config(spec, layout, DTYPES[ns.dtype], settings.dispatcher, ns.transformer_fields,
                                    **RECOMPUTE[settings.recompute], calculate_per_token_loss=True)
        check_model_config(config, profile, training=True)


def worlds(layouts: List[Layout]) -> Dict[int, List[Layout]]:
    """The layouts of each world size, smallest world first (world 1 holds the reference run)."""
    out: Dict[int, List[Layout]] = {1: []}
    for layout in layouts:
        out.setdefault(layout.world_size, []).append(layout)
    return dict(sorted(out.items()))


def meta_of(pl: Plan, ns) -> Dict[str, str]:
    from ...compat import megatron_version

    return {"model": json_digest(pl.spec.to_dict()), "profile": pl.profile.digest(),
            "settings": json_digest(pl.settings.to_dict()), "dtype": ns.dtype, "device": ns.device,
            "megatron-core": megatron_version(),
            "transformer config": json_digest(ns.transformer_fields),
            "modes": ",".join("vanilla" if v else "consistent" for v in pl.modes)}


def run(ns: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ...compat import megatron_version
    from ..builder import DTYPES
    from .. import hooks
    from ..driver import start_world
    from ..progress import Progress
    from . import report
    from .loop import train_layout

    pl = plan(ns)
    start_world(ns)
    world, rank = dist.get_world_size(), dist.get_rank()
    hooks.at_point("start", rank)
    mine = parse_layouts(ns.launch_layouts) if ns.launch_layouts is not None else pl.layouts
    wrong = [l.name for l in mine if l.world_size != world]
    if wrong:
        raise ConfigError(f"layout(s) {wrong} need tp*cp*pp*dp processes, this world has {world}; run them with "
                          f"mindspeed-tp train-check (one world per size) or launch that many processes")
    verify_same_on_all_ranks({"model config": pl.spec.to_dict(), "profile": pl.profile.to_dict(),
                              "settings": pl.settings.to_dict(), "dtype": ns.dtype, "layouts": [l.name for l in mine],
                              "megatron-core version": megatron_version(), "modes": pl.modes,
                              "transformer config": ns.transformer_fields})
    meta = meta_of(pl, ns)
    dtype = DTYPES[ns.dtype]
    progress = Progress(len(mine) * len(pl.modes) + (0 if ns.reference else len(pl.modes)), enabled=rank == 0)
    if ns.reference:
        reference = report.load_reference_run(ns.reference, meta, pl.modes, pl.settings.steps)
    elif world == 1:
        reference = {}
        for vanilla in pl.modes:
            progress.step(f"one device ({report.mode_name(vanilla)})")
            reference[report.mode_key(vanilla)] = train_layout(pl.spec, Layout(), dtype, pl.profile, pl.settings, vanilla,
                                                               load_state_path=ns.load_state)
        if ns.save_reference and rank == 0:
            report.save_reference_run(ns.save_reference, reference, meta)
    else:
        raise ConfigError(f"a world of {world} processes cannot hold the one-device run: pass --reference FILE "
                          f"(made by a one-process run with --save-reference), or use mindspeed-tp train-check")
    rows = []
    for layout in mine:
        for vanilla in pl.modes:
            progress.step(f"{layout.name} ({report.mode_name(vanilla)})")
            ref = reference[report.mode_key(vanilla)]
            save = ns.save_state if not vanilla else None
            # Vanilla megatron's CP lives in Transformer Engine (its local attention asserts CP = 1): vanilla
            # trains the same world with the CP ranks as DP ranks, and the row says so.
            run_layout = layout.cp_as_dp() if vanilla else layout
            out = train_layout(pl.spec, run_layout, dtype, pl.profile, pl.settings, vanilla, reference=ref,
                               load_state_path=ns.load_state, save_state_path=save,
                               checkpoint_dir=ns.checkpoint_dir if not vanilla else None)
            row = report.result_row(layout, vanilla, out, ref, pl, ns.dtype)
            if run_layout != layout:
                row["ran_as"] = run_layout.name
                row["note"] = (f"vanilla megatron-core runs CP only with Transformer Engine: trained at "
                               f"{run_layout.name}, the CP ranks as DP ranks")
            rows.append(row)
    progress.finish()
    code = 0
    if ns.results:  # launched by mindspeed-tp train-check: it merges the worlds and gives the verdict
        if rank == 0:
            report.write_part(ns.results, rows, reference)
    else:  # every rank holds the same rows; rank 0 prints
        code = report.finish([rows], report.reference_summary(reference), pl, ns, show=rank == 0)
    dist.barrier()
    dist.destroy_process_group()
    return code


def main(argv: Optional[List[str]] = None) -> int:
    return run_main(argv, resolve_args, run, "mindspeed-tp train-check")
