"""Train-vs-rollout mismatch over the response tokens: what an importance ratio sees."""
from __future__ import annotations

from typing import Dict

import torch

from ..metrics import bitwise_equal


def mismatch(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    """max |dlogp|, the k3 estimate of KL(rollout || train) (mean over tokens of r - 1 - log r,
    r = pi_train / pi_rollout, the tokens sampled from the rollout policy), max |r - 1| and the
    share of tokens whose logprobs have the same raw bits."""
    if not mask.any():  # nothing compared: no fraction that could read as a pass
        nan = float("nan")
        return dict(max_abs_logdiff=nan, mismatch_kl=nan, max_abs_ratio_minus_1=nan, bitwise_fraction=nan, tokens=0)
    a, b = train[mask].double(), rollout[mask].double()
    log_ratio = a - b
    ratio = log_ratio.exp()
    return dict(max_abs_logdiff=float(log_ratio.abs().max()),
                mismatch_kl=float((ratio - 1 - log_ratio).mean()),
                max_abs_ratio_minus_1=float((ratio - 1).abs().max()),
                bitwise_fraction=float(bitwise_equal(train[mask], rollout[mask]).double().mean()),
                tokens=int(mask.sum()))
