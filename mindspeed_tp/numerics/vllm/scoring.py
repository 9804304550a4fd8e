"""Which positions of a scored batch the engine computed in prefill and which as decode steps.

The engine runs a prompt as prefill and every generated position as a q_len=1 decode over the KV
blocks; its attention kernel tiles the two differently, so training must score each position
the same way (a whole-sequence prefill re-score differs). The forward reads the plan set here:

    with engine_scoring(prompt_lens=[...], vocab_size=V):
        logits = model(tokens, positions, mask)

``prompt_lens[i]``: sequence i's prompt length (positions >= it are decode steps); ``vocab_size``:
the real vocabulary (the engine's logprobs are over it, not over Megatron's padded one);
``prefill_chunks[i]`` (optional): the ends of the chunks the engine prefilled prompt i in, when its
token budget (max_num_batched_tokens) split it -- the attention kernel tiles a chunk from its own
first query, so a chunked prefill is scored chunk by chunk (measured: one whole-prompt prefill
differs by 7e-4 from a 1024 + 76 chunked one). Default: each prompt in one step.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ...contract.refusals import refuse
from ...errors import ConfigError


@dataclass(frozen=True)
class ScoringPlan:
    prompt_lens: Tuple[int, ...]
    vocab_size: int
    prefill_chunks: Optional[Tuple[Tuple[int, ...], ...]] = None

    def chunk_ends(self, i: int) -> Tuple[int, ...]:
        """Where sequence i's prefill steps ended (the last one at its prompt length)."""
        return self.prefill_chunks[i] if self.prefill_chunks else (self.prompt_lens[i],)


_local = threading.local()  # the plan of the engine_scoring block this thread is in


@contextmanager
def engine_scoring(prompt_lens: Sequence[int], vocab_size: int, prefill_chunks=None):
    if any(int(p) < 1 for p in prompt_lens):
        raise ConfigError("engine_scoring: every prompt needs at least one token")
    chunks = None
    if prefill_chunks is not None:
        chunks = tuple(tuple(int(e) for e in ends) for ends in prefill_chunks)
        for ends, p in zip(chunks, prompt_lens):
            if not ends or list(ends) != sorted(set(ends)) or ends[0] < 1 or ends[-1] != int(p):
                raise ConfigError(f"engine_scoring: prefill chunk ends {list(ends)} must increase and end at the "
                                  f"prompt length {p}")
        if len(chunks) != len(prompt_lens):
            raise ConfigError("engine_scoring: one list of prefill chunk ends per prompt")
    previous = getattr(_local, "plan", None)
    _local.plan = ScoringPlan(tuple(int(p) for p in prompt_lens), int(vocab_size), chunks)
    try:
        yield _local.plan
    finally:
        _local.plan = previous


def current_plan(batch: Optional[int] = None) -> ScoringPlan:
    plan = getattr(_local, "plan", None)
    if plan is None:
        raise refuse("vllm_scoring_plan")
    if batch is not None and batch != len(plan.prompt_lens):
        raise ConfigError(f"engine_scoring was given {len(plan.prompt_lens)} prompt lengths for a batch of {batch} "
                          f"sequences")
    return plan
