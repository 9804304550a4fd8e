"""The bundled verifiable task, and loading a user's reward function (``--reward module:function``).

A reward function takes a prompt and a response (token-id lists; the response without padding,
its EOS token included if it stopped on one) and returns a float. The bundled task
(``multiple-of-8``): the share of response tokens whose id is a multiple of 8 -- a random tiny model
meets it 1/8 of the time, and GRPO teaches it within the default 10 iterations (measured on
tiny-dense: 0.14 -> 0.65). A rule conditioned on the prompt (the parity of its last token) was
tried first: 10 iterations of 4x4 samples do not learn it measurably.
"""
from __future__ import annotations

import importlib
from typing import Callable, List

from ...errors import ConfigError

RewardFn = Callable[[List[int], List[int]], float]


def multiple_of_8_share(prompt: List[int], response: List[int]) -> float:
    if not response:
        return 0.0
    return sum(1 for t in response if t % 8 == 0) / len(response)


BUNDLED = {"multiple-of-8": multiple_of_8_share}


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
