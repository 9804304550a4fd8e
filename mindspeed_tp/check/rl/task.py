"""The bundled verifiable task, and loading a user's reward function (``--reward module:function``).

A reward function takes a prompt and a response (token-id lists; the response without padding,
its EOS token included if it stopped on one) and returns a float. The bundled task: the share of
response tokens whose id has the parity of the prompt's last token -- a rule of the prompt that a
random tiny model meets half the time and GRPO measurably teaches it.
"""
from __future__ import annotations

import importlib
from typing import Callable, List

from ...errors import ConfigError

RewardFn = Callable[[List[int], List[int]], float]


def parity_share(prompt: List[int], response: List[int]) -> float:
    if not response:
        return 0.0
    want = prompt[-1] % 2
    return sum(1 for t in response if t % 2 == want) / len(response)


BUNDLED = {"parity": parity_share}


def load_reward(name: str) -> RewardFn:
    """A bundled task by name, or ``module:function`` importable from here."""
    if name in BUNDLED:
        return BUNDLED[name]
    if ":" not in name:
        raise ConfigError(f"--reward {name!r}: a bundled task ({', '.join(BUNDLED)}) or module:function")
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--reward {name!r}: cannot import it ({type(exc).__name__}: {exc})") from exc
    if not callable(fn):
        raise ConfigError(f"--reward {name!r} is not callable")
    return fn


def score(fn: RewardFn, prompts: List[List[int]], responses: List[List[int]]) -> List[float]:
    out = []
    for p, r in zip(prompts, responses):
        value = fn(list(p), list(r))
        try:
            out.append(float(value))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"--reward returned {value!r} for a response; it must return a float") from exc
    return out
