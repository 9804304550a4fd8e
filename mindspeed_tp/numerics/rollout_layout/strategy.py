"""The rollout-layout strategy (profile ``reduction: rollout_layout``): training reproduces a stock
rollout engine running at TP=R, whatever its own layout (the math: the modules beside this one;
its patch entries: ``patches.py``).

Row-parallel layers (attention out-proj, MLP and expert down-proj) compute the engine's R partials
for this rank's output columns; logprobs are one fp32 log-softmax over the whole vocab. Everything
else is the canonical tree's (row-local, so the same bits as the engine's reference kernels). The
engine is the project's reference engine (``reference/``); a real engine's strategy subclasses this
one with its own kernels (``numerics/vllm/strategy.py``)."""
from __future__ import annotations

import functools

from ... import state
from ...contract.refusals import refuse
from ...kernels import mask_padded_vocab
from ...kernels.collectives import group_rank
from ..canonical.strategy import CanonicalTree
from .engine_math import full_vocab_log_softmax, masked_log_softmax
from .linear import full_vocab_parallel_logprob, rollout_layout_linear


class RolloutLayout(CanonicalTree):
    name = "rollout_layout"
    # The engine's partial GEMM ``gemm(x, w) -> x @ w.T`` (None: the torch reference GEMM) and its
    # log-softmax over full-vocab rows (None: one fp32 log-softmax).
    partial_gemm = None
    log_softmax = None

    def partial_gemm_for(self, weight):
        """The partial GEMM for row-parallel ``weight`` (a real engine keys its packed-weight cache on it)."""
        return self.partial_gemm

    def check_expert_ffn(self, ffn: int) -> None:
        """K of an expert's fc2 is cut into the engine's rollout_tp parts."""
        self.profile.check_rollout_k(ffn, "moe_ffn_hidden_size")

    def row_linear(self, layer, input_, group):
        """The stock engine's R partials for this rank's output columns (input gathered along K,
        weight re-laid out by output columns)."""
        if layer.bias is not None:
            raise refuse("rollout_row_bias", cls=type(layer).__name__)
        self.profile.check_rollout_k(
            layer.input_size, f"input size of {type(layer).__name__} (heads*kv_channels or ffn_hidden_size)")
        output = rollout_layout_linear(input_, layer.weight, group, self.profile, bool(layer.sequence_parallel),
                                       gemm=self.partial_gemm_for(layer.weight))
        return output, None

    def expert_down_proj(self, a, weight, bias, etp_group, dtype, rows):
        """per_expert: the expert's down-proj reduced as the engine's row-parallel layer (a bias, as
        any row-parallel one here, refused)."""
        if bias is not None:
            raise refuse("rollout_row_bias", cls="an expert's linear_fc2")
        return rollout_layout_linear(a, weight, etp_group, self.profile, sequence_parallel=False,
                                     replicated_output=False)

    def logprob(self, logits, target, group, vocab_size):
        """The engine's one fp32 log-softmax over the whole vocab, shards exchanged in token chunks;
        under processed semantics after the engine's top-k / top-p mask of each full row."""
        start = group_rank(group) * logits.shape[-1]
        logits = mask_padded_vocab(logits, vocab_size, start)
        log_softmax = self.log_softmax or full_vocab_log_softmax
        sampling = state.sampling_mask()
        if sampling is not None:
            log_softmax = functools.partial(masked_log_softmax, log_softmax,
                                            lambda rows: self.top_k_top_p(rows, sampling), vocab_size)
        return full_vocab_parallel_logprob(logits, target, group, log_softmax=log_softmax)
