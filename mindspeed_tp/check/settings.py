"""The checkers' training settings: one type. ``TrainSettings`` is what a training run needs (steps,
batch, optimizer, recompute, dispatcher); ``RLSettings`` is the same plus the rollout and GRPO fields
of rl-check, whose global batch is one iteration's rollouts (prompts x group size)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from ..contract.sampling import Sampling


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 3
    micro_batch_size: int = 2
    global_batch_size: int = 8
    seq_length: int = 64
    lr: float = 3e-3
    distributed_optimizer: bool = False
    overlap: bool = False
    recompute: str = "none"
    dispatcher: str = "alltoall"
    seed: int = 1234

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(TrainSettings)}


# What rl-check's settings digest and reports hold, in this order (the state files and references
# already written carry it).
_RL_KEYS = ("prompts", "group_size", "max_prompt", "max_new_tokens", "temperature", "eos_token_id",
            "micro_batch_size", "logprob_micro_batch_size", "logprob_max_tokens", "lr", "clip_ratio", "seed",
            "seq_length", "distributed_optimizer")


@dataclass(frozen=True)
class RLSettings(TrainSettings):
    """One RL iteration's training step is one ``TrainSettings`` step over its rollouts."""
    steps: int = 1
    seq_length: int = 32  # every batch is padded to this (fixed: the same shapes in every iteration and layout)
    lr: float = 1e-2
    distributed_optimizer: bool = True
    prompts: int = 4
    group_size: int = 4
    max_prompt: int = 12
    max_new_tokens: int = 16
    temperature: float = 1.0
    eos_token_id: Optional[int] = None
    logprob_micro_batch_size: int = 4
    logprob_max_tokens: Optional[int] = None  # a token budget per forward-only micro-batch instead
    clip_ratio: float = 0.2
    top_k: int = 0
    top_p: float = 1.0
    logprob_semantics: str = "temperature"

    def __post_init__(self):
        object.__setattr__(self, "global_batch_size", self.prompts * self.group_size)

    @property
    def sampling(self) -> Sampling:
        """What the engine samples with and which logprob the loop compares and trains on."""
        return Sampling(self.temperature, self.top_k, self.top_p, self.logprob_semantics)

    def to_dict(self):
        data = {name: getattr(self, name) for name in _RL_KEYS}
        # the sampling fields only where they differ from the defaults every earlier run had
        for name, default in (("top_k", 0), ("top_p", 1.0), ("logprob_semantics", "temperature")):
            if getattr(self, name) != default:
                data[name] = getattr(self, name)
        return data
