"""Which logprob of a sampled token is compared: the sampling settings and the logprob semantics.

A rollout engine samples at a temperature T, often with top-k / top-p, and returns a logprob of the
sampled token; training recomputes it. Three semantics (``--logprob-semantics``, profile field
``logprob_semantics``):

- ``raw``: log_softmax(logits), before temperature (vLLM's ``raw_logprobs``). The sampling policy's
  only at T = 1 without top-k / top-p.
- ``temperature``: log_softmax(logits / T) (verl's actor: ``logits.div_(T)`` then its logprob;
  vLLM's ``processed_logprobs`` when top-k and top-p are off).
- ``processed``: log_softmax over what top-k / top-p keep of logits / T, renormalised over the kept
  set (vLLM's ``processed_logprobs``): the distribution the token was sampled from.

Greedy sampling (T = 0) scores at T = 1 with no mask under every semantics, as vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from ..errors import ConfigError

SEMANTICS = ("raw", "temperature", "processed")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0            # 0 (or -1, vLLM's spelling): off
    top_p: float = 1.0        # 1: off
    semantics: str = "raw"

    def __post_init__(self):
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", max(0, int(self.top_k)))
        object.__setattr__(self, "top_p", float(self.top_p))
        if self.semantics not in SEMANTICS:
            raise ConfigError(f"--logprob-semantics must be one of {SEMANTICS}, got {self.semantics!r}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in (0, 1] (1: off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """Whether sampling cuts the vocab (top-k or top-p on, T > 0)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def scoring_temperature(self) -> float:
        """The temperature the compared logprob divides the logits by."""
        return 1.0 if self.semantics == "raw" or self.greedy else self.temperature

    @property
    def masks(self) -> bool:
        """Whether the compared logprob is renormalised over the kept set."""
        return self.semantics == "processed" and self.filters

    def to_dict(self) -> Dict[str, object]:
        return {"logprob_semantics": self.semantics, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p}

    def describe(self) -> str:
        parts = [f"T={self.temperature:g}" if not self.greedy else "greedy"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1.0:
            parts.append(f"top-p {self.top_p:g}")
        return f"{self.semantics} logprobs ({', '.join(parts)})"


def resolve_semantics(flag: Optional[str], profile_field: Optional[str], default: str) -> str:
    """--logprob-semantics, else the profile's ``logprob_semantics``, else the checker's default."""
    return flag or profile_field or default
