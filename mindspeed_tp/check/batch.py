"""Seeded scoring batches: sequences of different lengths, right-padded."""
from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class ScoringBatch:
    tokens: torch.Tensor  # (b, s) long, right-padded with pad_id
    lengths: List[int]
    # Positions to score; default: every position whose next token is real. Rollouts score only
    # the positions that predict response tokens.
    score_mask: Optional[torch.Tensor] = None
    # Positions holding real tokens (default: before each length); --bisect compares these.
    real_mask: Optional[torch.Tensor] = None
    # Rollouts: each sequence's prompt length (a real engine's prefill; later positions were its
    # decode steps). None: the whole sequence is one prompt.
    prompt_lens: Optional[List[int]] = None
    # ... and where the engine's prefill chunks of each prompt ended (None: one step per prompt).
    prefill_chunks: Optional[List[List[int]]] = None

    @property
    def targets(self) -> torch.Tensor:
        """Token t+1 is the target of position t (the last column's target is padding)."""
        return torch.cat([self.tokens[:, 1:], self.tokens[:, -1:]], dim=1)

    @property
    def real(self) -> torch.Tensor:
        """(b, s) bool: positions holding a real token (not right padding)."""
        if self.real_mask is not None:
            return self.real_mask
        b, s = self.tokens.shape
        return torch.arange(s).unsqueeze(0) < torch.tensor(self.lengths).unsqueeze(1)

    @property
    def scored(self) -> torch.Tensor:
        """(b, s) bool: positions whose next token is a real token of the sequence."""
        if self.score_mask is not None:
            return self.score_mask
        b, s = self.tokens.shape
        pos = torch.arange(s).unsqueeze(0)
        return pos + 1 < torch.tensor(self.lengths).unsqueeze(1)


def make_batch(vocab_size: int, seed: int, batch_size: int, seq_length: int, pad_id: int = 0) -> ScoringBatch:
    gen = torch.Generator().manual_seed(seed + 7919)
    lengths = [seq_length] + [
        int(x) for x in torch.randint(2, seq_length + 1, (batch_size - 1,), generator=gen)
    ]
    tokens = torch.randint(0, vocab_size, (batch_size, seq_length), generator=gen)
    for i, n in enumerate(lengths):
        tokens[i, n:] = pad_id
    return ScoringBatch(tokens=tokens, lengths=lengths)
