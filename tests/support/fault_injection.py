"""Fault injection for the checker's own tests: a checker plugin (mindspeed_tp/check/hooks.py),
loaded by ``MINDSPEED_TP_CHECK_PLUGINS=fault_injection`` with tests/support on PYTHONPATH (the
tests' launch helpers in conftest.py set both whenever a test sets ``MINDSPEED_TP_TEST_FAULT``).

``MINDSPEED_TP_TEST_FAULT`` holds comma-separated directives. The tests use it to prove that the
checker's diagnostics work on real runs:

  exit@POINT:RANK         rank RANK exits abruptly (``os._exit(17)``) on reaching POINT
  kill@POINT:RANK         rank RANK is killed (SIGKILL: no handler, no report) on reaching POINT
  hang@POINT:RANK         rank RANK sleeps (for an hour) on reaching POINT: a hung rank
  segv@POINT:RANK         rank RANK reads address 0 on reaching POINT: a segfault in native code
  refuse@POINT:RANK       rank RANK raises a ConfigError on reaching POINT: a refusal only one rank meets
  perturb:PARAM           in every layout except the single-device reference, scale element 0 of the
                          full parameter PARAM (global name, e.g. decoder.layers.2.mlp.linear_fc2.weight)
                          by 1.5: a kernel that computes a different output from the same inputs
  perturb-input:MODULE    same layouts: add 1 to element 0 of MODULE's input hidden states: the
                          framework handing a module different inputs
  nan-logits:B:S          same layouts: logit 0 of batch row B at position S becomes NaN
  raise-vanilla:LAYOUT     vanilla megatron-core's forward of LAYOUT raises on every rank (RANK: on
                          one rank only, raise-vanilla:LAYOUT:RANK): an install vanilla cannot run on
  perturb-step-logprobs   rl-check: the training step's gathered logprobs of the first scored token
                          move by one ulp (the step's forward differing from the forward-only pass)

POINTs: ``start`` (process group up, before any check), ``forward`` (before each layout's forward);
train-check: ``start`` and ``after-step-N`` (step N's checkpoint complete).
"""
from __future__ import annotations

import os
import signal
import time
from typing import List, Tuple

import torch

ENV = "MINDSPEED_TP_TEST_FAULT"


def _directives() -> List[Tuple[str, str]]:
    text = os.environ.get(ENV, "").strip()
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        kind, _, arg = item.partition(":")
        out.append((kind, arg))
    return out


def at_point(point: str, rank: int) -> None:
    """exit@POINT / kill@POINT / hang@POINT / refuse@POINT / segv@POINT for this rank."""
    for kind, arg in _directives():
        action, _, where = kind.partition("@")
        if where != point or action not in ("exit", "kill", "hang", "refuse", "segv") or int(arg) != rank:
            continue
        if action == "refuse":
            from mindspeed_tp.errors import ConfigError

            raise ConfigError(f"injected: a refusal only rank {rank} meets")
        if action == "exit":
            os._exit(17)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "segv":
            import ctypes

            ctypes.string_at(0)
        time.sleep(3600)


def apply_to_model(model, layout, tp_rank: int) -> list:
    """perturb / perturb-input on this stage (single-device layouts are left alone). Returns hook
    handles to remove after the forward."""
    from mindspeed_tp.models.weights import global_param_name
    from mindspeed_tp.check.bisect import global_module_name

    import mindspeed_tp

    handles = []
    for kind, arg in _directives():
        name, _, rank = arg.partition(":")
        if kind == "raise-vanilla" and not mindspeed_tp.is_enabled() and name == layout.name and (
                not rank or int(rank) == torch.distributed.get_rank()):
            raise RuntimeError(f"injected: vanilla cannot run {layout.name}")
    if layout.required_world_size == 1:
        return handles
    for kind, arg in _directives():
        if kind == "perturb" and tp_rank == 0:  # TP rank 0 holds element 0 of every sharded weight
            for local_name, param in model.named_parameters():
                if global_param_name(model, local_name) == arg:
                    with torch.no_grad():
                        param.view(-1)[0] = param.view(-1)[0] * 1.5
        elif kind == "perturb-input" and tp_rank == 0:
            for local_name, module in model.named_modules():
                if global_module_name(model, local_name) == arg:
                    handles.append(module.register_forward_pre_hook(_bump_input, with_kwargs=True))
    return handles


def _bump_input(module, args, kwargs):
    if args:
        x = args[0].clone()
        x.view(-1)[0] += 1
        return (x,) + tuple(args[1:]), kwargs
    x = kwargs["hidden_states"].clone()
    x.view(-1)[0] += 1
    return args, dict(kwargs, hidden_states=x)


def corrupt_logits(logits: torch.Tensor, layout, tp_rank: int) -> torch.Tensor:
    """nan-logits:B:S on the rank holding vocab column 0 (GPTModel returns logits [b, s, vocab/tp])."""
    if layout.required_world_size == 1:
        return logits
    for kind, arg in _directives():
        if kind == "nan-logits" and tp_rank == 0:
            b, s = (int(x) for x in arg.split(":"))
            logits = logits.clone()
            logits[b, s, 0] = float("nan")
    return logits


def perturb_step_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if not any(kind == "perturb-step-logprobs" for kind, _ in _directives()) or not mask.any():
        return logprobs
    out = logprobs.clone()
    b, s = (int(i) for i in torch.nonzero(mask)[0])
    out[b, s] = torch.nextafter(out[b, s], torch.tensor(float("inf"), dtype=out.dtype))
    return out


def register(hooks) -> None:
    """The checker plugin entry (mindspeed_tp/check/hooks.py)."""
    hooks.add("point", lambda name, rank: at_point(name, rank))
    hooks.add("before_forward", apply_to_model)
    hooks.add("logits", corrupt_logits)
    hooks.add("step_logprobs", perturb_step_logprobs)
