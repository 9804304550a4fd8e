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

    def select(self, rows: torch.Tensor) -> "ScoringBatch":
        """The sequences ``rows`` (a micro-batch), with their lengths, score mask and prompt lengths."""
        idx = rows.tolist()
        return ScoringBatch(tokens=self.tokens[rows], lengths=[self.lengths[i] for i in idx],
                            score_mask=self.scored[rows],
                            prompt_lens=None if self.prompt_lens is None else [self.prompt_lens[i] for i in idx])

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


@dataclass
class PackedBatch:
    """A ScoringBatch as packed (thd) sequences, the way verl's remove-padding path packs them:
    each sequence's real tokens, padded at its end to a multiple of ``align`` (the TP size, so an SP
    split of the packed length divides evenly), concatenated into one row."""
    tokens: torch.Tensor     # (1, T)
    positions: torch.Tensor  # (1, T): each sequence from 0
    targets: torch.Tensor    # (1, T): the next token of the same sequence (pad after its end)
    cu_seqlens: List[int]    # sequence i in columns cu_seqlens[i]:cu_seqlens[i+1]

    def packed_seq_params(self, device=None):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor(self.cu_seqlens, dtype=torch.int32, device=device)
        longest = max(b - a for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                               cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest)

    def padded_index(self, column: int, s: int, none: int) -> int:
        """Packed column -> flat index i*s+pos in the padded layout (``none`` past every sequence)."""
        for i, (a, b) in enumerate(zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])):
            if a <= column < b:
                return i * s + min(column - a, s - 1)
        return none

    def unpack_tokens(self, rows: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """(..., T, E) per packed token -> (..., s*b, E) in Megatron's sequence-major order
        (token (i, pos) at pos*b+i; positions past a sequence: 0)."""
        out = rows.new_zeros(*rows.shape[:-2], s * b, rows.shape[-1])
        for i, (a, e) in enumerate(zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])):
            n = min(e - a, s)
            out[..., torch.arange(n) * b + i, :] = rows[..., a : a + n, :]
        return out

    def unpack(self, packed: torch.Tensor, shape) -> torch.Tensor:
        """(1, T) per-token values -> (b, s) in the padded layout (positions past a sequence: 0)."""
        out = torch.zeros(shape, dtype=packed.dtype)
        for i, (a, b) in enumerate(zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])):
            n = min(b - a, shape[1])
            out[i, :n] = packed[0, a : a + n]
        return out


def pack_batch(batch: ScoringBatch, align: int, pad_id: int = 0) -> PackedBatch:
    tokens, targets, positions, cu = [], [], [], [0]
    for i, n in enumerate(batch.lengths):
        width = -(-n // align) * align
        seq = torch.full((width,), pad_id, dtype=batch.tokens.dtype)
        seq[:n] = batch.tokens[i, :n]
        tokens.append(seq)
        targets.append(torch.cat([seq[1:], seq.new_full((1,), pad_id)]))
        positions.append(torch.arange(width))
        cu.append(cu[-1] + width)
    return PackedBatch(torch.cat(tokens).unsqueeze(0), torch.cat(positions).unsqueeze(0),
                       torch.cat(targets).unsqueeze(0), cu)
