"""Distances between two per-token logprob tensors over the scored tokens; tensors' raw bits."""
import hashlib
from typing import Dict

import torch

from ..errors import ConfigError


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise equality of the raw fp32 bit patterns (so -0 != +0 and NaN == same NaN)."""
    return a.float().contiguous().view(torch.int32) == b.float().contiguous().view(torch.int32)


def tensor_digest(t: torch.Tensor) -> str:
    """16 hex digits of the SHA-256 of the tensor's raw bytes."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


_INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The bitwise claim for whole tensors: same shape, same dtype and the same raw bits (viewed as
    integers: -0.0 and +0.0 differ, NaNs compare by their bits), not torch.equal's value equality."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = _INT_VIEWS[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def compare_logprobs(test: torch.Tensor, ref: torch.Tensor, scored: torch.Tensor) -> Dict[str, float]:
    """NaN/inf are counted and located (``nonfinite_*``); the distances cover the tokens finite in both
    runs, so one NaN cannot hide (or become) the maximum."""
    bad_test = ~torch.isfinite(test.float()) & scored
    bad_ref = ~torch.isfinite(ref.float()) & scored
    nonfinite = int(bad_test.sum()) + int(bad_ref.sum())
    first = torch.nonzero(bad_test | bad_ref)
    finite = scored & ~bad_test & ~bad_ref
    a, b = test[finite].float(), ref[finite].float()
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
        # nothing scored: NaN, never a fraction that reads as a pass
        "bitwise_equal_fraction": (float(bitwise_equal(test[scored], ref[scored]).double().mean())
                                   if scored.any() else float("nan")),
        "max_abs_probdiff": float(prob.max()) if prob.numel() else 0.0,
        "pearson": pearson,
        "tokens": int(scored.sum()),
        "nonfinite_values": nonfinite,
        "nonfinite_test": int(bad_test.sum()),
        "nonfinite_reference": int(bad_ref.sum()),
        "first_nonfinite": first[0].tolist() if len(first) else None,  # [batch, position]
    }


def logdiff_per_position(test: torch.Tensor, ref: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """(s,) max |dlogp| over the batch at each position (NaN where nothing finite is scored)."""
    diff = (test.double() - ref.double()).abs()
    ok = scored & torch.isfinite(diff)
    masked = torch.where(ok, diff, torch.full_like(diff, -1.0)).amax(dim=0)
    return torch.where(masked < 0, torch.full_like(masked, float("nan")), masked)


def require_scored(scored: torch.Tensor, what: str) -> None:
    """Refuse a batch with no scored token: a check that compares nothing must not pass."""
    if not bool(scored.any()):
        raise ConfigError(f"no token is scored in {what}: nothing would be compared; give prompts of at least two "
                          "tokens or responses of at least one (--prompts, --max-new-tokens, --eos-token-id)")
