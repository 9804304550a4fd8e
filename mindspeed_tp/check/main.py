"""The consistency checker: distributed logprobs vs a single-device run of the same weights.

Launched by torchrun (``python -m mindspeed_tp.check``) or by ``mindspeed-tp check``, which starts
torchrun itself. Exit codes: 0 every scored token bitwise equal, 1 not, 2 bad input or usage, 3 the run crashed
(a rank died, hung past --timeout, or raised).
"""
from __future__ import annotations

import argparse
import faulthandler
import hashlib
import io
import json
import math
import os
import sys
import time
from functools import reduce
from typing import Dict, List, NamedTuple, Optional

import yaml

from ..compat import megatron_version, vanilla_layout_problem
from ..contract.profile import Profile, load_profile
from ..contract.refusals import refuse
from ..contract.sampling import SEMANTICS, Sampling, resolve_semantics
from ..errors import ConfigError
from ..hf import open_hf_model
from ..kernels.collectives import gather_along_rank
from ..kernels.dispatch import build_identity
from . import bisect, builder, hooks, user_config
from .batch import make_batch
from .driver import CUDA_MISSING, run_device, start_world
from .harness import layout_logprobs
from .library_warnings import add_verbose_flag
from .metrics import compare_logprobs, require_scored
from .builder import DTYPES
from ..models.layout import Layout, validate_layout
from ..models.spec import ModelSpec, load_model_spec
from ..models.weights import SeededWeights
from .outputs import write_reports
from .progress import Progress
from .prompts import batch_from_prompts, load_prompts
from .reference import load_reference, reference_metadata, save_reference
from .report import format_table, mode_name, write_json_atomic
from .rollout import make_rollouts

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
DEFAULTS = dict(
    model=None, hf_checkpoint=None, prompts=None, profile="default", tp=1, pp=1, sp=False, ep=1, etp=1, cp=1, dispatcher="alltoall", layouts=None, dtype="bf16", seed=1234,
    batch_size=4, seq_length=144, json=None, vanilla=False, compare_vanilla=False, reference=None,
    save_reference=None, dump_logprobs=None, timeout=600.0, rollout=0, temperature=0.0, top_k=0, top_p=1.0, logprob_semantics=None, max_new_tokens=16,
    engine="reference", engine_max_batched_tokens=None,
    device="cpu", packed=False,
    bisect=False, bisect_dump=None, report_md=None, plot=None, verbose=False, transformer_config=None,
)


class UsageError(ConfigError):
    pass


class CheckerParser(argparse.ArgumentParser):
    """The checkers' argument parser: a usage error raises (exit 2 through ``run_main``)."""

    def error(self, message):  # argparse exits 2 already; keep its message, raise for one path
        raise UsageError(f"{self.prog}: {message}")


def require_counts(ns: argparse.Namespace, names) -> None:
    """Each of the checker's ``names`` (counts) is >= 1 and ``--timeout`` is positive."""
    for name in names:
        if int(getattr(ns, name)) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if float(ns.timeout) <= 0:
        raise ConfigError("--timeout must be > 0 seconds")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """--top-k, --top-p and --logprob-semantics, as check and rl-check take them."""
    p.add_argument("--top-k", type=int, metavar="K", help="rollout top-k (0 or -1: off, the default)")
    p.add_argument("--top-p", type=float, metavar="P", help="rollout top-p (1: off, the default)")
    p.add_argument("--logprob-semantics", choices=SEMANTICS,
                   help="which logprob of a sampled token is compared: raw (log_softmax(logits), before temperature), "
                        "temperature (log_softmax(logits / T), verl's actor) or processed (after top-k / top-p, "
                        "renormalised over the kept tokens: vLLM's processed_logprobs); default: the profile's "
                        "logprob_semantics, else temperature")


def sampling_from(ns: argparse.Namespace, profile: Profile, default: str) -> Sampling:
    """The rollout sampling and the compared logprob's semantics from the flags and the profile."""
    semantics = resolve_semantics(ns.logprob_semantics, profile.logprob_semantics, default)
    return Sampling(temperature=float(ns.temperature), top_k=int(ns.top_k), top_p=float(ns.top_p),
                    semantics=semantics)


def check_engine_and_device(ns: argparse.Namespace, spec, profile) -> None:
    """Before any worker starts: the profile matches ``--engine``, the device exists (``check_device``),
    and the real engine can run the model (it would crash in its attention kernel)."""
    if ns.engine == "vllm" and profile.engine_name != "vllm":
        raise ConfigError(f"--engine vllm needs a profile matching the real engine (--profile vllm-cpu-tp1 or "
                          f"vllm-cpu-tp2); {profile.name!r} describes {profile.reduction}")
    check_device(ns)
    if spec.multi_latent_attention:  # before the engine's own checks: its MLA is another attention
        from ..contract.model_config import check_mla_profile

        check_mla_profile(profile)
        if profile.engine_name == "vllm":
            from ..numerics.vllm.mla import check_model

            check_model(spec, DTYPES[ns.dtype], profile.name)
    if ns.engine == "vllm":
        from ..numerics.vllm.refusals import (activation_widths, check_activation_widths, check_engine_architecture,
                                              check_head_dim, check_partial_rope_dtype)

        check_engine_architecture(spec)
        if spec.multi_latent_attention:  # the engine's MLA backend, not its attention kernel
            from ..numerics.vllm.mla import check_host

            check_host()
        else:
            check_head_dim(spec.kv_channels)
        check_partial_rope_dtype(spec.rotary_percent, DTYPES[ns.dtype])
        check_activation_widths(activation_widths(spec), profile.rollout_tp, DTYPES[ns.dtype])
        if spec.is_moe:
            from ..numerics.vllm.forward import moe_problems

            problems = moe_problems(spec, profile)
            if problems:
                raise refuse("vllm_moe", problems="; ".join(problems))


def build_parser(prog: str = "mindspeed-tp check") -> argparse.ArgumentParser:
    p = CheckerParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file (or bundled name, e.g. 'demo') whose keys set any flag below")
    p.add_argument("--model", help="bundled model name (default tiny-dense) or a model config YAML path")
    p.add_argument("--hf-checkpoint", metavar="DIR",
                   help="Hugging Face checkpoint directory (Qwen3, Qwen3-MoE, Qwen2 / Qwen2.5, Llama, Mistral, Mixtral, GLM-4.5, "
                        "DeepSeek-V3 / Kimi-K2 / Moonlight, gpt-oss) (config.json + safetensors): the model "
                        "and its weights, instead of --model and seeded weights")
    p.add_argument("--prompts", metavar="FILE",
                   help="JSONL prompts, one per line: [token ids], {\"input_ids\": [...]} or {\"text\": ...} (text "
                        "needs a tokenizer in --hf-checkpoint); scored as given, or used as rollout prompts")
    p.add_argument("--profile", help="numerics profile: bundled name or YAML path (default: default)")
    p.add_argument("--tp", type=int, help="tensor-parallel size")
    p.add_argument("--pp", type=int, help="pipeline-parallel size")
    p.add_argument("--sp", action="store_true", default=None, help="sequence parallel")
    p.add_argument("--ep", type=int, help="expert-parallel size (MoE models)")
    p.add_argument("--etp", type=int, help="expert tensor-parallel size (MoE models; default 1)")
    p.add_argument("--cp", type=int, help="context-parallel size (each sequence in 2*CP chunks, Megatron's layout; "
                                          "default 1)")
    p.add_argument("--dispatcher", choices=["alltoall", "allgather"], help="MoE token dispatcher (default alltoall)")
    p.add_argument("--layouts", help="comma-separated layouts to check in one run, e.g. tp2,tp2-sp,tp4-sp-pp2,tp2-sp-ep2-etp2")
    p.add_argument("--dtype", choices=["fp32", "bf16"])
    p.add_argument("--seed", type=int, help="seed of the weights and of the scored tokens")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--json", help="write the report as JSON to this path")
    p.add_argument("--vanilla", action="store_true", default=None, help="no patches: plain megatron-core")
    p.add_argument("--compare-vanilla", action="store_true", default=None,
                   help="also run plain megatron-core and print it next to mindspeed-tp")
    p.add_argument("--reference", help="load the single-device reference from this safetensors file")
    p.add_argument("--save-reference", help="save the single-device reference to this safetensors file")
    p.add_argument("--dump-logprobs", metavar="DIR",
                   help="save every run's raw per-token logprobs (and the scored mask) as safetensors in DIR")
    p.add_argument("--rollout", type=int, metavar="N",
                   help="generate N responses with the reference rollout engine (paged KV, chunked prefill, decode, "
                        "continuous batching) and compare the training forward's logprobs of the response tokens "
                        "with the engine's")
    p.add_argument("--temperature", type=float, help="rollout sampling temperature (0: greedy); training scores "
                                                     "the logprob --logprob-semantics names at this temperature")
    add_sampling_flags(p)
    p.add_argument("--max-new-tokens", type=int, help="rollout response length (default 16)")
    p.add_argument("--engine", choices=["reference", "vllm"],
                   help="rollout engine for --rollout: the bundled reference engine (default) or the real vLLM "
                        "(vllm-cpu, started here at the profile's rollout_tp; needs a vllm-cpu-* profile and the "
                        "vllm extra); vLLM's returned logprobs are compared, with vanilla and the canonical "
                        "profile alongside")
    p.add_argument("--engine-max-batched-tokens", type=int, metavar="N",
                   help="--engine vllm: the engine's max_num_batched_tokens (default: every prompt in one step); "
                        "given, requests are generated one at a time and prompts longer than N are chunked "
                        "prefills, scored chunk by chunk (greedy only: vllm-cpu 0.32 crashes on seeded sampling "
                        "with a chunked prefill)")
    add_device_flag(p)
    p.add_argument("--packed", action="store_true", default=None,
                   help="score the layouts' sequences packed into one row (thd, PackedSeqParams with cu_seqlens, as "
                        "verl's use_remove_padding does); the single-device reference stays padded (bshd), so "
                        "equality shows both packed == padded and layout invariance")
    p.add_argument("--timeout", type=float, help="seconds any collective, pipeline transfer or wait for another rank may "
                                                 "take before the check fails with exit code 3 (default 600)")
    p.add_argument("--bisect", action="store_true", default=None,
                   help="record every module's output in both runs and report the first module that differs "
                        "(kernel or framework), the layers and tokens affected")
    p.add_argument("--bisect-dump", metavar="DIR", help="with --bisect (implied): save both runs' module tensors "
                                                         "as safetensors in DIR")
    p.add_argument("--report-md", metavar="FILE", help="write the report as Markdown")
    p.add_argument("--plot", metavar="FILE.png", help="plot |dlogp| per token position and per layer (implies "
                                                      "--bisect; needs matplotlib: pip install mindspeed-tp[plot])")
    add_verbose_flag(p)
    user_config.add_argument(p)
    p.add_argument("--status-file", help=argparse.SUPPRESS)
    return p


def override(merged: dict, args: argparse.Namespace) -> dict:
    """``merged`` (defaults, a config) with every flag given on the command line (not None) over it."""
    for key, value in vars(args).items():
        if value is not None and key in merged:
            merged[key] = value
    return merged


def resolve_args(argv: Optional[List[str]]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    merged = dict(DEFAULTS)
    if args.config:
        path = args.config
        if not os.path.isfile(path):
            path = os.path.join(CONFIG_DIR, f"{args.config}.yaml")
        if not os.path.isfile(path):
            raise ConfigError(f"--config {args.config!r} is neither a file nor a bundled config")
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        unknown = sorted(set(data) - set(DEFAULTS))
        if unknown:
            raise ConfigError(f"--config {path}: unknown key(s) {unknown}; known: {sorted(DEFAULTS)}")
        if isinstance(data.get("layouts"), list):
            data["layouts"] = ",".join(data["layouts"])
        merged.update(data)
    override(merged, args)
    merged["status_file"] = args.status_file
    ns = argparse.Namespace(**merged)
    require_counts(ns, ("batch_size", "seq_length", "max_new_tokens"))
    if int(ns.rollout) < 0 or float(ns.temperature) < 0:
        raise ConfigError("--rollout and --temperature must be >= 0")
    ns.sampling = sampling_from(ns, load_profile(ns.profile), default="temperature")
    if (ns.sampling.top_k or ns.sampling.top_p < 1.0) and not int(ns.rollout):
        raise ConfigError("--top-k/--top-p cut the vocab a rollout samples from: give --rollout N")
    if ns.plot:
        from .plot import require_matplotlib

        require_matplotlib()
    ns.bisect = bool(ns.bisect or ns.bisect_dump or ns.plot)
    ns.transformer_fields = user_config.load(ns.transformer_config)
    if ns.engine == "vllm":
        if not int(ns.rollout):
            raise ConfigError("--engine vllm compares the engine's rollouts: give --rollout N")
        if ns.engine_max_batched_tokens is not None and float(ns.temperature) > 0:
            raise ConfigError("--engine-max-batched-tokens with --temperature > 0: vllm-cpu 0.32 crashes on seeded "
                              "sampling when a prompt is a chunked prefill ('CPU Generator does not use offset'); "
                              "use --temperature 0, or drop --engine-max-batched-tokens")
        if ns.bisect or ns.reference or ns.save_reference or ns.vanilla:
            raise ConfigError("--engine vllm: --bisect/--plot, --reference, --save-reference and --vanilla are not "
                              "supported (vanilla and the canonical profile are shown alongside)")
    if ns.packed:
        _check_packed_flags(ns)
    return ns


def _check_packed_flags(ns: argparse.Namespace) -> None:
    """What --packed does not combine with, by name."""
    combos = (
        (ns.vanilla or ns.compare_vanilla, "--vanilla/--compare-vanilla",
         "megatron-core's local DotProductAttention has no packed-sequence path (only Transformer Engine's has)"),
        (ns.bisect, "--bisect/--bisect-dump/--plot", "the module recorder reassembles padded (bshd) activations only"),
        (int(ns.rollout), "--rollout", "score the rollouts padded (drop --packed)"),
        (ns.reference or ns.save_reference, "--reference/--save-reference",
         "the reference is the in-process padded single-device run"),
    )
    for bad, flag, why in combos:
        if bad:
            raise refuse("packed_checker_combination", flag=flag, why=why)


class Plan(NamedTuple):
    spec: ModelSpec
    profile: Profile
    layouts: List[Layout]
    modes: List[bool]
    weights: object                   # SeededWeights or hf.HFWeights
    prompts: Optional[List[List[int]]]


def plan(ns: argparse.Namespace) -> Plan:
    """Static validation of everything the run needs: model, weights, profile, prompts, layouts."""

    profile = load_profile(ns.profile)
    if ns.reference:
        reference_metadata(ns.reference)  # a file that is no safetensors is refused before any launch
    if ns.hf_checkpoint:
        if ns.model:
            raise ConfigError("--model and --hf-checkpoint both given: the checkpoint's config.json defines the "
                              "model; drop --model")

        spec, weights = open_hf_model(ns.hf_checkpoint, profile)
    else:
        spec = load_model_spec(ns.model or "tiny-dense")
        weights = SeededWeights(spec, int(ns.seed))
    if ns.layouts:
        layouts = [Layout.parse(x) for x in str(ns.layouts).split(",") if x.strip()]
    else:
        layouts = [Layout(tp=int(ns.tp), pp=int(ns.pp), sp=bool(ns.sp), ep=int(ns.ep), etp=int(ns.etp),
                          cp=int(ns.cp))]
    prompts = None
    if ns.prompts:

        prompts = load_prompts(ns.prompts, spec, ns.hf_checkpoint)
        if not int(ns.rollout):  # scored as given: the batch is as long as the longest prompt
            multiple = required_world_size(layouts) * 8
            ns.seq_length = -(-max(len(p) for p in prompts) // multiple) * multiple
    check_engine_and_device(ns, spec, profile)
    for layout in layouts:
        validate_layout(layout, spec, profile, int(ns.seq_length))
        if layout.cp > 1 and ns.bisect:
            raise ConfigError(f"--bisect with layout {layout.name}: module outputs are compared on one rank; run "
                              "--bisect at the same layout without cpN")
    if ns.seq_length > spec.max_position_embeddings:
        raise ConfigError(
            f"--seq-length={ns.seq_length} exceeds the model's max_position_embeddings={spec.max_position_embeddings}"
        )
    builder.check_before_launch(spec, layouts, profile, DTYPES[ns.dtype], ns.transformer_fields, ns.dispatcher)
    modes = [True] if ns.vanilla else ([True, False] if ns.compare_vanilla else [False])
    return Plan(spec, profile, layouts, modes, weights, prompts)


def required_world_size(layouts: List[Layout]) -> int:
    return reduce(lambda a, b: a * b // math.gcd(a, b), [l.required_world_size for l in layouts], 1)


def json_digest(obj) -> str:
    """16 hex digits of the SHA-256 of ``obj`` as sorted JSON (what a reference file's meta holds)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def verify_same_on_all_ranks(fields: Dict[str, object]) -> None:
    """Every rank must check the same model, profile and inputs; name everything that differs, on
    which ranks and hosts (nodes of a multi-node run)."""
    import socket

    import torch
    import torch.distributed as dist


    names = sorted(fields)
    mine = torch.tensor([int(json_digest(fields[n]), 16) & ((1 << 62) - 1) for n in names], dtype=torch.int64)
    gathered = gather_along_rank(mine, dist.group.WORLD)
    host = torch.zeros(64, dtype=torch.uint8)
    raw = socket.gethostname().encode()[:64]
    host[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    hosts = [bytes(h.tolist()).rstrip(b"\0").decode(errors="replace") for h in gather_along_rank(host, dist.group.WORLD)]
    problems = []
    for i, name in enumerate(names):
        column = gathered[:, i]
        if not torch.all(column == column[0]):
            bad = [r for r in range(column.numel()) if column[r] != column[0]]
            where = sorted({hosts[r] for r in bad})
            problems.append(f"{name}: rank(s) {bad} (host(s) {', '.join(where)}) differ from rank 0 "
                            f"(host {hosts[0]})")
    if problems:
        raise ConfigError(
            "ranks disagree on " + "; ".join(problems)
            + ". Check that every node has the same files, flags and package versions"
        )


def _file_digest(path: Optional[str]) -> str:
    """What a rank sees of a file every node must have (e.g. a shipped --reference)."""
    if not path:
        return "none"
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def routing_mismatch(routing, reference, batch) -> float:
    """Fraction of scored tokens whose chosen expert set differs from the reference in any layer."""
    if routing is None or reference is None:
        return float("nan")
    b, s = batch.tokens.shape
    differs = (routing != reference).any(dim=-1).any(dim=0)  # (s*b,), Megatron order t = s*B + b
    differs = differs.reshape(s, b).t()
    scored = batch.scored
    return float(differs[scored].double().mean()) if scored.any() else 0.0


def add_device_flag(p: argparse.ArgumentParser) -> None:
    """``--device``, the same for every checker."""
    p.add_argument("--device", choices=["cpu", "cuda", "npu"],
                   help="where the models run: cpu (gloo, default), cuda (each rank's GPU, local rank modulo the "
                        "GPUs; NCCL, or gloo with host-staged collectives when ranks share a GPU) or npu (each "
                        "rank's Ascend NPU; HCCL for the model's collectives); kernels by the profile's backend")


# How long a rank whose vanilla arm raised waits for the others to report theirs (seconds): a failure
# of the install (no TE, no apex) raises on every rank at the same point; one rank failing alone
# re-raises after it, as before.
VANILLA_AGREE_S = 120.0


def _arm(vanilla: bool, timeout_s: float, run):
    """(run(), None), or for a vanilla arm alongside mindspeed-tp's (``vanilla``) that raised on every
    rank (None, reason): vanilla megatron-core that cannot run on this install is a row, not the end of
    the check. mindspeed-tp's own arm is never caught, nor a vanilla-only run's. Every rank takes part in
    the agreement after every such arm."""
    import datetime

    import torch
    import torch.distributed as dist

    if not vanilla:
        return run(), None
    error = None
    try:
        result = run()
    except Exception as exc:  # noqa: BLE001 -- vanilla megatron-core's own failure, reported as a row
        error, result = exc, None
    wait = min(VANILLA_AGREE_S, timeout_s) if error is not None else timeout_s
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=wait))
    except RuntimeError:
        if error is not None:  # the other ranks did not fail with it: the run fails as it would have
            raise error
        raise
    failed = torch.tensor([int(error is not None)])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not int(failed):
        return result, None
    if error is None:
        return None, "it raised on another rank; its error is in that rank's output"
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    print(f"mindspeed-tp check: vanilla megatron-core cannot run here: {type(error).__name__}: {first}",
          file=sys.stderr)
    return None, f"{type(error).__name__}: {first}"[:200]


def check_device(ns: argparse.Namespace) -> None:
    """Before any worker starts: a CUDA run needs a GPU here, and the real engine the checkers start is
    vllm-cpu (its profiles describe vLLM on the CPU)."""
    import torch

    if ns.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(CUDA_MISSING)
    if getattr(ns, "engine", None) == "vllm" and ns.device != "cpu":
        raise ConfigError(f"--engine vllm with --device {ns.device}: the vllm-cpu profiles describe vLLM on the CPU; "
                          "use --device cpu, or the bundled reference engine (--engine reference), which runs on "
                          "the checker's device")


def run(ns: argparse.Namespace) -> int:
    import torch.distributed as dist

    spec, profile, layouts, modes, weights, prompts = plan(ns)
    start_world(ns)
    rank = dist.get_rank()
    hooks.at_point("start", rank)
    dtype = DTYPES[ns.dtype]
    inputs = {"seed": ns.seed, "batch_size": ns.batch_size, "seq_length": ns.seq_length, "dtype": ns.dtype,
              "rollout": int(ns.rollout), "temperature": float(ns.temperature),
              "max_new_tokens": int(ns.max_new_tokens), "prompts": json_digest(prompts) if prompts else None,
              "packed": bool(ns.packed)}
    if int(ns.rollout):
        inputs.update(ns.sampling.to_dict())
    kernel_build = build_identity(run_device().type)  # the triton backend: its version and FP contraction
    verify_same_on_all_ranks(
        {"model config": spec.to_dict(), "profile": profile.to_dict(), "inputs": inputs, "device": ns.device,
         "kernel build": kernel_build,
         "layouts": [l.name for l in layouts], "megatron-core version": megatron_version(),
         "transformer config": ns.transformer_fields,
         "checker flags": {"bisect": ns.bisect, "vanilla": ns.vanilla, "compare_vanilla": ns.compare_vanilla,
                           "dispatcher": ns.dispatcher, "reference given": bool(ns.reference), "engine": ns.engine}}
    )
    rollout = int(ns.rollout) > 0
    sampling = ns.sampling if rollout else None  # what the engine samples with and which logprob is compared
    engine_modules = None
    engine_report = None
    if rollout and ns.engine == "vllm":
        from .rollout import make_vllm_rollouts

        multiple = required_world_size(layouts) * 8
        batch, engine_lp, engine_report = make_vllm_rollouts(
            spec, profile, ns.dtype, int(ns.seed), int(ns.rollout), int(ns.max_new_tokens), sampling,
            int(ns.seq_length) // 2, multiple, weights, prompts, ns.hf_checkpoint, ns.engine_max_batched_tokens)
        from ..numerics.vllm.host import check_engine_family

        check_engine_family(engine_report["cpu_isa"])  # every rank: another node may be another host type
    elif rollout:
        multiple = required_world_size(layouts) * 8  # any SP split of the scored length divides evenly
        batch, engine_lp, engine_modules = make_rollouts(
            spec, profile, dtype, int(ns.seed), int(ns.rollout), int(ns.max_new_tokens), sampling,
            int(ns.seq_length) // 2, multiple, weights, prompts, run_device(), record_modules=ns.bisect)
        if batch.tokens.shape[1] > spec.max_position_embeddings:
            raise ConfigError("--seq-length/--max-new-tokens exceed the model's max_position_embeddings")
    elif prompts:
        batch = batch_from_prompts(prompts, int(ns.seq_length))
    else:
        batch = make_batch(spec.vocab_size, int(ns.seed), int(ns.batch_size), int(ns.seq_length))
    require_scored(batch.scored, "the checked batch")
    # What every rank computes from must be the same bits: weights (seeded by this torch, or the
    # checkpoint's files), the token batch, and a reference file shipped to every node.
    verify_same_on_all_ranks(
        {"weights digest": weights.digest(profile),
         "input tokens": hashlib.sha256(batch.tokens.numpy().tobytes()).hexdigest(),
         "reference file": _file_digest(ns.reference)}
    )
    meta = {"model": json_digest(spec.to_dict()), "profile": profile.digest(), "inputs": json_digest(inputs),
            "weights": json_digest(weights.describe()), "transformer config": json_digest(ns.transformer_fields)}
    if kernel_build:  # a reference computed by other compiled kernels is refused by name
        meta["kernel build"] = json_digest(kernel_build)
    loaded = load_reference(ns.reference, meta) if ns.reference else {}
    single = Layout()
    # (key, vanilla, profile) per mode; against the real engine, vanilla and the canonical-tree
    # profile run alongside (their distance to the engine is reported, not judged).
    runs = [("vanilla" if v else "consistent", v, profile) for v in modes]
    if ns.engine == "vllm":
        runs = [("consistent", False, profile), ("vanilla", True, profile), ("canonical", False, load_profile("default"))]
        modes = [v for _, v, _ in runs]
    results, refs, dumps, ref_routing, ref_modules, curves = [], {}, {}, {}, {}, []
    vanilla_cannot_run = None  # why vanilla's one-device reference could not run, if it could not
    steps = (0 if rollout else sum(k not in loaded for k in ("vanilla" if v else "consistent" for v in modes))) \
        + len(layouts) * len(modes)
    progress = Progress(steps, enabled=rank == 0)
    for key, vanilla, run_profile in runs:
        if rollout:
            refs[key], ref_routing[key] = engine_lp, None
            ref_modules[key] = engine_modules or {}
        elif key in loaded:
            refs[key] = loaded[key]
            if ns.bisect:
                ref_modules[key] = bisect.from_flat(loaded, key, spec.num_layers)
                if not ref_modules[key]:  # every rank loaded the same file (digest verified)
                    raise ConfigError(f"--bisect with --reference {ns.reference}: the file has no module outputs; "
                                      "make it with --save-reference and --bisect")
        else:
            progress.step(f"reference (tp1, {'vanilla' if vanilla else 'mindspeed-tp'})")
            diag = {"record_modules": ns.bisect}
            ran, cannot = _arm(vanilla and bool(ns.compare_vanilla), float(ns.timeout), lambda: layout_logprobs(
                spec, single, dtype, run_profile, int(ns.seed), batch, vanilla, ns.dispatcher, weights=weights,
                diagnostics=diag))
            if cannot:
                vanilla_cannot_run = f"its one-device reference: {cannot}"
                continue
            refs[key], ref_routing[key] = ran
            ref_modules[key] = diag.get("modules", {})
    # Layout outer, mode inner: Megatron's parallel state is built once per layout.
    for layout in layouts:
        def unsupported(why: str) -> Dict:  # vanilla's row where it cannot run this layout
            return dict(layout=layout.to_dict(), vanilla=True, unsupported=why,
                        megatron_core_version=megatron_version(), model=spec.name, dtype=ns.dtype)

        for key, vanilla, run_profile in runs:
            problem = (vanilla_cannot_run or vanilla_layout_problem(spec, layout)) if vanilla else None
            if problem:
                if not ns.compare_vanilla:
                    raise ConfigError(f"--vanilla with layout {layout.name}: {problem}")
                results.append(unsupported(problem))
                progress.done += 1
                continue
            label = {"consistent": "mindspeed-tp"}.get(key, key)
            progress.step(f"{layout.name} ({label})")
            diag = {"record_modules": ns.bisect}
            # Vanilla megatron's CP lives in Transformer Engine (its local attention asserts CP = 1):
            # vanilla runs the same layout without CP, and the report says so.
            run_layout = layout.without_cp() if vanilla else layout
            ran, cannot = _arm(vanilla and bool(ns.compare_vanilla), float(ns.timeout), lambda: layout_logprobs(
                spec, run_layout, dtype, run_profile, int(ns.seed), batch, vanilla, ns.dispatcher, sampling, weights,
                diagnostics=diag, packed=bool(ns.packed)))
            if cannot:
                results.append(unsupported(f"cannot run ({cannot})"))
                continue
            lp, routing = ran
            r = compare_logprobs(lp, refs[key], batch.scored)
            r.update(logits_nonfinite=diag["logits_nonfinite"], logits_first_nonfinite=diag["logits_first_nonfinite"])
            if spec.is_moe:
                r["routing_mismatch_fraction"] = routing_mismatch(routing, ref_routing.get(key), batch)
                r["dispatcher"] = ns.dispatcher
            r.update(
                layout=layout.to_dict(), vanilla=vanilla, mode=label, profile=run_profile.name,
                profile_digest=run_profile.digest(),
                megatron_core_version=megatron_version(), model=spec.name, dtype=ns.dtype, seed=int(ns.seed),
                device=ns.device, packed=bool(ns.packed), kernel_build=kernel_build,
                reduction=run_profile.reduction,
                reference=("vLLM" if ns.engine == "vllm" else "rollout engine") if rollout else "single device (tp1)",
            )
            if run_layout != layout:
                r["ran_as"] = run_layout.name
                r["note"] = (f"vanilla megatron-core runs CP only with Transformer Engine: compared at "
                             f"{run_layout.name}, without CP")
            if run_profile.rollout_layout:  # the stock engine's TP size this run reproduces
                r["rollout_tp"] = run_profile.rollout_tp
            if engine_report is not None:
                r.update(engine=engine_report, alongside=key != "consistent")
            if rollout:
                r.update(rollout=int(ns.rollout), max_new_tokens=int(ns.max_new_tokens), **sampling.to_dict())
            if ns.bisect and rank == 0:
                r["bisect"] = bisect.bisect_report(diag["modules"], ref_modules[key], batch, ns.bisect_dump,
                                                   f"{key}-{layout.name}", meta)
            curves.append((r, lp, refs[key]))
            results.append(r)
            dumps[f"{key}/{layout.name}"] = lp
            if routing is not None:
                dumps[f"{key}/routing/{layout.name}"] = routing
    progress.finish()
    results.sort(key=lambda r: r["vanilla"], reverse=True)  # vanilla rows first, then ours
    if ns.save_reference and rank == 0:
        extra = {}
        if ns.bisect and not rollout:
            for key, run_modules in ref_modules.items():
                extra.update(bisect.to_flat(run_modules, key))
        save_reference(ns.save_reference, dict(refs, **extra), meta)
    if ns.dump_logprobs and rank == 0:
        dumps.update({f"{k}/reference": v for k, v in refs.items()}, scored=batch.scored)
        dumps.update({f"{k}/routing/reference": v for k, v in ref_routing.items() if v is not None})
        save_reference(os.path.join(ns.dump_logprobs, "logprobs.safetensors"), dumps, meta)
    judged = [r for r in results if not r["vanilla"] and not r.get("alongside")] or results
    judged = [r for r in judged if "unsupported" not in r]
    ok = all(r["tokens"] > 0 and r["bitwise_equal_fraction"] == 1.0 and r["nonfinite_values"] == 0 for r in judged)
    if rank == 0:
        print(f"mindspeed-tp check: model={spec.name} dtype={ns.dtype} profile={profile.name} "
              f"megatron-core={megatron_version()} world={dist.get_world_size()}")
        if engine_report is not None:
            print(f"engine: vLLM {engine_report['version']} tp={engine_report['tp']} started in "
                  f"{engine_report['start_seconds']:.0f}s, generated in {engine_report['generate_seconds']:.0f}s; "
                  f"kernels: {engine_report['kernels']}")
        if rollout:
            print(f"compared: {sampling.describe()}")
        print(format_table(results))
        for r in results:
            if r.get("bisect"):
                print(bisect.format_bisect(r["bisect"], f"{r['layout']['name']} ({mode_name(r)})"))
        against = "the rollout engine's logprobs" if rollout else "the single-device run"
        verdict = ("bitwise equal" if ok else "NOT bitwise equal") + " to " + against
        print("RESULT:", verdict)
        if ns.json:
            report = dict(results[0]) if len(results) == 1 else {}
            report.update(results=results, all_bitwise_equal=ok)
            write_json_atomic(ns.json, report)
        write_reports(ns, results, curves, batch, verdict,
                      header={"model": spec.name, "dtype": ns.dtype, "profile": profile.name,
                              "megatron-core": megatron_version(), "world": dist.get_world_size(),
                              "seed": int(ns.seed)})
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


# How long a rank that met a ConfigError waits for the others to meet it too (they raise the same
# refusal at the same point, within seconds) before it leaves alone.
REFUSAL_BARRIER_S = 20.0


def _shutdown_distributed() -> bool:
    """Leave the process group cleanly on an error path: every rank raises the same ConfigError at
    the same point, and a process exiting with a live gloo group can abort its peers. False when the
    other ranks did not arrive within REFUSAL_BARRIER_S (a refusal only this rank met, while they wait
    in another collective): the caller then exits at once, never waiting for --timeout."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    if not _every_rank_refused(dist, REFUSAL_BARRIER_S):
        return False
    try:
        dist.barrier()  # every rank is here: the barrier cannot meet another collective
    except RuntimeError:  # a peer already left; nothing more to agree on
        return False
    dist.destroy_process_group()
    return True


def _every_rank_refused(dist, wait_s: float) -> bool:
    """Whether every rank of the world reached its refusal within ``wait_s``: counted in the launch's
    rendezvous store, not by a collective, which could meet a peer's collective elsewhere and wait
    for it (gloo's monitored_barrier did, past its own timeout)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # no store to count in: agree by the barrier
        return True
    world, key = dist.get_world_size(), "mindspeed_tp/refused"
    arrived = store.add(key, 1)
    deadline = time.monotonic() + wait_s
    while arrived < world:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
        arrived = store.add(key, 0)
    return True


def _crash_message(exc: BaseException, timeout: float) -> str:
    """One readable line for a rank that cannot finish: which rank, what, and the likely cause."""
    import socket

    text = " ".join(str(exc).split())
    if len(text) > 400:
        text = text[:400] + " ..."
    where = f"rank {os.environ.get('RANK', '0')} on {socket.gethostname()}"
    if isinstance(exc, RuntimeError):  # torch.distributed errors (DistBackendError, ...) are RuntimeErrors
        return (f"{where}: the run failed in a collective or transfer: another rank died, or hung longer than "
                f"--timeout={timeout:g}s ({type(exc).__name__}: {text})")
    return f"{where}: the run crashed: {type(exc).__name__}: {text}"


def _write_status(status_file: Optional[str], code: int, message: str) -> None:
    """Every rank reports to the launcher (node-local file per local rank), atomically."""
    if not status_file:
        return
    path = f"{status_file}.{os.environ.get('LOCAL_RANK', '0')}"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"exit_code": code, "error": message, "rank": int(os.environ.get("RANK", "0"))}, f)
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    return run_main(argv, resolve_args, run, "mindspeed-tp check")



def exit_worker(code: int) -> None:
    """How a checker process started as a module ends: output flushed, then out without the
    interpreter's teardown. torch's gloo teardown can abort a process whose work is done ("terminate
    called without an active exception", SIGABRT: a C++ thread destroyed while a work object or
    group outlives destroy_process_group into interpreter exit, seen after --bisect's verdict); its
    status file and reports are written by then (tests/workers/worker_exit.py does the same)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _dump_stacks_on_fatal_signals() -> None:
    """faulthandler on the process's stderr (every Python thread's stack); not where stderr is no file (a
    caller capturing it). Then torch's native handler, which runs first and prints every thread's C++
    frames: a crash in a library's own thread (gloo's workers) shows no Python frame of its own."""
    try:
        faulthandler.enable()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return
    import torch

    set_native = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if set_native is not None:
        set_native(True)


def run_main(argv: Optional[List[str]], resolve, run_fn, prog: str) -> int:
    """A torchrun entry's error handling and status report (shared by check and train-check):
    ``resolve(argv)`` the flags, ``run_fn(ns)`` the exit code; ConfigError is 2, a crash 3. A fatal
    signal (a segfault in a native library) prints every thread's Python stack first, so the log says
    where a rank died."""
    _dump_stacks_on_fatal_signals()
    status_file, timeout = None, float(DEFAULTS["timeout"])
    try:
        ns = resolve(argv)
        status_file, timeout = ns.status_file, float(ns.timeout)
        code, message = run_fn(ns), ""
    except ConfigError as exc:
        code, message = 2, str(exc)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        if not _shutdown_distributed():  # the others are elsewhere: report and leave (torchrun stops them)
            _write_status(status_file, code, message)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    except Exception as exc:  # noqa: BLE001 - a dead or hung peer, or a bug: fail loudly, never hang
        message = _crash_message(exc, timeout)
        if not isinstance(exc, RuntimeError):  # not a peer's failure: show where it broke
            import traceback

            traceback.print_exc()
        if not status_file:  # else the launcher prints it, after torchrun's own report
            print(f"{prog}: error: {message}", file=sys.stderr)
        _write_status(status_file, 3, message)
        sys.stdout.flush()
        sys.stderr.flush()
        # A normal exit would wait on the broken group's threads; exiting non-zero also makes
        # torchrun stop this node's other ranks (a hung one included).
        os._exit(3)
    _write_status(status_file, code, message)
    if status_file:
        return 0  # the launcher reads the status files; torchrun would bury our code under its own
    return code
