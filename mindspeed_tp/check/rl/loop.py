"""The iterations of one arm (mindspeed-tp or vanilla megatron-core) in one layout.

Per iteration k: rollouts from the engine (it holds the current weights), rewards, verl's GRPO
advantages, the forward-only logprob pass (compared with the rollout's logprobs: the mismatch),
the training step with the rollout's logprobs as the old ones, then the new weights to the engine.
Iteration k's prompts and sampling seeds depend on (seed, k) only, so a run resumed from a saved
state at iteration k+1, in any layout, continues the same trajectory.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from ... import disable, enable
from .. import hooks
from ..driver import build_ddp_chunks, make_optimizer, release_models, setup_parallel_state, wire_config
from ..rollout import rollout_batch, rollout_prompts
from ..settings import RLSettings
from ..train.state_file import load_state, save_state
from . import grpo, task
from .engines import prompts_and_responses
from ..metrics import tensor_digest
from .metrics import mismatch
from .step import forward_logprobs, train_step
from .weights import full_parameters


def iteration_prompts(spec, settings: RLSettings, iteration: int) -> List[List[int]]:
    """P prompts of seeded lengths, each repeated G times (request i: prompt i // G)."""
    distinct = rollout_prompts(spec, settings.seed + 7919 * iteration, settings.prompts, settings.max_prompt)
    return [p for p in distinct for _ in range(settings.group_size)]


def run_arm(spec, layout, dtype, profile, settings: RLSettings, vanilla: bool, engine, reward_fn,
            first: int, last: int, load_state_path=None, save_state_path=None) -> List[Dict]:
    """Iterations ``first..last`` (1-based, inclusive); one row per iteration (identical on every
    rank). ``engine`` lives on rank 0 (None elsewhere)."""
    disable() if vanilla else enable(profile)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    setup_parallel_state(layout, settings.seed, training=True)
    # (a real-engine profile's model sets its own fp32 pipeline_dtype: the stages exchange its residual stream)
    chunks, wrapped, ddp_config = build_ddp_chunks(spec, layout, dtype, profile, settings)
    optimizer = make_optimizer(wrapped, dtype, settings)
    if load_state_path:
        load_state(load_state_path, spec, layout, chunks, optimizer)
    wire_config(chunks[0].config, wrapped, ddp_config, optimizer)
    forward_backward = get_forward_backward_func()
    config = grpo.actor_config(settings.clip_ratio, settings.group_size)

    def loss(old, new, adv, mask):
        return grpo.policy_loss(old, new, adv, mask, config)

    n = settings.prompts * settings.group_size
    rows = []
    full = full_parameters(spec, layout, profile, chunks)
    for k in range(first, last + 1):
        prompts = iteration_prompts(spec, settings, k)
        rollouts = None
        if dist.get_rank() == 0:
            engine.sync(full)  # the weights of the policy about to sample
            rollouts = engine.generate(prompts, settings.sampling, settings.max_new_tokens,
                                       settings.seed * 1000 + k * 100003, settings.eos_token_id)
        batch, rollout_lp = rollout_batch(rollouts, n, settings.seq_length)
        mask = batch.scored
        rewards = task.score(reward_fn, *prompts_and_responses(batch))
        adv = grpo.advantages(rewards, mask, settings.group_size)
        train_lp = forward_logprobs(forward_backward, wrapped, spec, profile, vanilla, settings.sampling, batch,
                                    layout, settings.logprob_micro_batch_size, settings.logprob_max_tokens)
        step_lp = train_step(forward_backward, wrapped, optimizer, spec, profile, vanilla, settings.sampling,
                             batch, layout, settings.micro_batch_size, rollout_lp, adv, loss)
        step_lp = hooks.on_step_logprobs(step_lp, mask)
        # The reported loss: verl's global token-mean of the step's policy loss, from the gathered
        # in-step logprobs (the same tensors on every rank, one fixed order).
        global_loss = grpo.policy_loss(rollout_lp, step_lp, adv, mask, config, agg="token-mean")
        row = dict(iteration=k, reward_mean=float(torch.tensor(rewards, dtype=torch.float64).mean()),
                   loss=float(global_loss), **mismatch(train_lp, rollout_lp, mask))
        step = mismatch(step_lp, rollout_lp, mask)
        row.update(step_bitwise_fraction=step["bitwise_fraction"], step_max_abs_logdiff=step["max_abs_logdiff"],
                   response_lengths=[int(x) for x in mask.sum(1).tolist()],
                   prompt_lengths=[int(p) for p in batch.prompt_lens],
                   tokens_digest=tensor_digest(batch.tokens), rewards=[float(r) for r in rewards])
        rows.append(row)
        full = full_parameters(spec, layout, profile, chunks)
    if rows and dist.get_rank() == 0:
        engine.sync(full)  # the engine ends on the final weights too
    if save_state_path:
        save_state(save_state_path, spec, layout, profile, chunks, optimizer, last)
    release_models(wrapped, chunks[0].config)  # the next arm in this process gets the memory back
    return rows

