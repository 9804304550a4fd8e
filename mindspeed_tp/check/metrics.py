"""Distances between two per-token logprob tensors over the scored tokens."""
from typing import Dict

import torch


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise equality of the raw fp32 bit patterns (so -0 != +0 and NaN == same NaN)."""
    return a.float().contiguous().view(torch.int32) == b.float().contiguous().view(torch.int32)


def compare_logprobs(test: torch.Tensor, ref: torch.Tensor, scored: torch.Tensor) -> Dict[str, float]:
    a, b = test[scored].float(), ref[scored].float()
    nonfinite = int((~torch.isfinite(a)).sum()) + int((~torch.isfinite(b)).sum())
    da, db = a.double(), b.double()
    diff = (da - db).abs()
    prob = (da.exp() - db.exp()).abs()
    if a.numel() > 1 and float(da.std()) > 0 and float(db.std()) > 0:
        pearson = float(torch.corrcoef(torch.stack([da, db]))[0, 1])
    else:
        pearson = 1.0 if torch.equal(a, b) else float("nan")
    return {
        "max_abs_logdiff": float(diff.max()) if diff.numel() else 0.0,
        "mean_abs_logdiff": float(diff.mean()) if diff.numel() else 0.0,
        "bitwise_equal_fraction": float(bitwise_equal(a, b).double().mean()) if a.numel() else 1.0,
        "max_abs_probdiff": float(prob.max()) if prob.numel() else 0.0,
        "pearson": pearson,
        "tokens": int(a.numel()),
        "nonfinite_values": nonfinite,
    }
