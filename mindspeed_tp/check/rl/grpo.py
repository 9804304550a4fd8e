"""GRPO through the installed verl (``verl.trainer.ppo.core_algos``): the outcome advantage and the
clipped (vanilla) policy loss, with the rollout's logprobs as the old logprobs -- verl's
``rollout_correction.bypass_mode``, exact when training's logprobs are the engine's.

The loss of a micro-batch is verl's ``token-sum`` aggregation: megatron's per-token loss scaling
(``calculate_per_token_loss``) then divides the summed gradients by the global token count, which
is verl's global ``token-mean`` without a per-micro-batch rounding of the divisor.
"""
from __future__ import annotations

from typing import List

import torch

from ...errors import ConfigError


def _core_algos():
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as exc:
        raise ConfigError("mindspeed-tp rl-check needs verl (pip install --no-deps verl==0.9.1 and its import deps; "
                          "scripts/setup_env.sh installs it in every venv)") from exc
    return core_algos


def actor_config(clip_ratio: float, group_size: int):
    """verl's own ActorConfig for the loss (clip ratios; no per-batch normalisation info)."""
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="megatron", clip_ratio=float(clip_ratio), ppo_micro_batch_size_per_gpu=1,
                       use_dynamic_bsz=False, ppo_mini_batch_size=1, rollout_n=int(group_size))


def advantages(rewards: List[float], response_mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, s) per-token advantages: sequence i belongs to prompt i // group_size."""
    import numpy as np

    n = response_mask.shape[0]
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    for i, r in enumerate(rewards):  # verl sums a sequence's token rewards: the outcome on one token
        cols = torch.nonzero(response_mask[i]).flatten()
        if len(cols):
            token_rewards[i, cols[-1]] = float(r)
    index = np.array([i // group_size for i in range(n)])
    adv, _ = _core_algos().compute_grpo_outcome_advantage(token_rewards, response_mask.float(), index)
    return adv


def policy_loss(old_logprobs, logprobs, adv, mask, config, agg: str = "token-sum") -> torch.Tensor:
    """verl's clipped policy loss (``compute_policy_loss_vanilla``) of these tokens."""
    loss, _ = _core_algos().compute_policy_loss_vanilla(old_logprobs, logprobs, adv, mask.float(),
                                                        loss_agg_mode=agg, config=config)
    return loss
