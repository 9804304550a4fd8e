"""verl's actor scoring what its vLLM rollout computed (``vllm-cpu-*`` profiles under ``mindspeed_tp.verl``).

A real-engine profile reproduces the engine's logprob of each sampled token only when training knows
how the engine computed it:

- which positions were the prompt's prefill and which were decode steps: each micro-batch's prompt
  lengths, from verl's batch (``prompts`` and the left/right-padded ``attention_mask`` it keeps beside
  the unpadded ``input_ids``), set around verl's forward by ``engine_scoring`` with the Hugging Face
  vocab size -- old, ref and the loss's logprobs alike, every pipeline stage;
- which logprob the rollout returned: verl's ``rollout.logprobs_mode`` with its temperature, top-k and
  top-p (``rollout_sampling``; under the emulated engines' profiles, ``rollout-tp*``, too, with the
  reference engine's mask, which is vLLM's CPU algorithm op for op). vLLM's ``processed_logprobs`` (verl's default) at top-k / top-p are
  renormalised over the kept set, so verl's actor, which divides the logits by T, then takes the
  engine's own top-k / top-p mask of each row before its log-softmax (``processed`` semantics): its
  logprob is the one of the distribution the token was sampled from, the rollout's, bit for bit.
  Without a cut this is verl's own ``log_softmax(logits / T)``;
- the engine settings the profile assumes, read off verl's rollout config at the worker's start
  (``check_rollout_config``): refused by verl's key otherwise, before any model is built.

A rollout whose responses were not decoded in one piece (multi-turn: tool outputs prefilled as a new
turn inside the response) is refused at the forward (``verl_multi_turn_scoring``).
"""
from __future__ import annotations

import functools
from typing import List, Optional

from .. import state
from ..contract.refusals import refuse
from ..contract.sampling import Sampling
from ..numerics import ACTIVE

VERL_HYBRID_WORKER = "verl.workers.engine_workers:ActorRolloutRefWorker.__init__"
VERL_FORWARD_STEP = "verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.forward_step"

_rollout: Optional[Sampling] = None  # the logprob this process's verl rollout returns (set at the worker's start)


def rollout_known() -> bool:
    """Whether this process's verl worker read its rollout's logprob settings (engine-reproducing profiles)."""
    return _rollout is not None


def _is_engine_profile(profile) -> bool:
    """A real engine's profile (vllm-cpu-*): its kernels, its scoring plan, its settings."""
    from ..numerics.vllm.forward import is_vllm

    return is_vllm(profile)


def _reproduces_an_engine(profile) -> bool:
    """A profile that reproduces a rollout engine (real or emulated: ``reduction: rollout_layout``), whose
    logprob is therefore the rollout's semantics; the canonical tree keeps verl's own."""
    return getattr(profile, "reduction", None) == "rollout_layout"


def rollout_sampling(rollout) -> Sampling:
    """The logprob verl's rollout returns for each sampled token, as ``Sampling`` (temperature, top-k,
    top-p, semantics), from its config; refused where verl's actor, which divides by T, cannot compute it."""
    mode = str(rollout.get("logprobs_mode", "processed_logprobs"))
    temperature = float(rollout.get("temperature", 1.0))
    top_k, top_p = int(rollout.get("top_k", -1)), float(rollout.get("top_p", 1.0))
    semantics = {"processed_logprobs": "processed", "raw_logprobs": "raw"}.get(mode)
    if semantics is None or temperature <= 0 or (semantics == "raw" and temperature != 1.0):
        raise refuse("verl_rollout_logprobs", mode=mode, temperature=temperature)
    return Sampling(temperature, top_k, top_p, semantics)


def _same_logprob(a: Sampling, b: Sampling) -> bool:
    return a.scoring_temperature == b.scoring_temperature and a.masks == b.masks


def _budget_prefills_whole_prompts(rollout) -> bool:
    """vLLM splits a prompt's prefill only with chunked prefill on and a step's token budget short of
    every scheduled sequence's prompt (each step schedules at most max_num_seqs of them)."""
    if not rollout.get("enable_chunked_prefill", True):
        return True
    budget, seqs = rollout.get("max_num_batched_tokens"), rollout.get("max_num_seqs")
    prompt = rollout.get("prompt_length")
    return None not in (budget, seqs, prompt) and int(budget) >= int(seqs) * int(prompt)


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def _dtype_name(value) -> str:
    name = str(value).replace("torch.", "")
    return _DTYPES.get(name, name)


def check_rollout_config(rollout, profile, model_dtype=None) -> Sampling:
    """verl's rollout settings against a real-engine profile: each one the profile assumes, else refused
    by its verl key (``verl_rollout_setting``); ``model_dtype``: the actor's (its megatron ``dtype``), which
    the engine must compute in. Returns the rollout's logprob semantics."""
    engine_kwargs = (rollout.get("engine_kwargs") or {}).get("vllm") or {}
    multi_turn = rollout.get("multi_turn") or {}
    dtype = _dtype_name(rollout.get("dtype", "bfloat16"))
    model = _dtype_name(model_dtype) if model_dtype is not None else dtype
    eager, cached = bool(rollout.get("enforce_eager")), bool(rollout.get("enable_prefix_caching"))
    block = engine_kwargs.get("block_size", profile.engine.block_size)
    # (verl key, its value, whether the profile models it, the value to set, why)
    settings = (
        ("dtype", dtype, dtype == model, model,
         "the engine computes in the dtype the actor's model has (actor_rollout_ref.actor.megatron.dtype)"),
        ("name", rollout.get("name"), rollout.get("name") == "vllm", "vllm", "the profile models vLLM's kernels"),
        ("tensor_model_parallel_size", rollout.get("tensor_model_parallel_size"),
         rollout.get("tensor_model_parallel_size") == profile.rollout_tp, profile.rollout_tp,
         f"the {profile.name} profile models the engine at tensor_parallel_size={profile.rollout_tp}"),
        ("expert_parallel_size", rollout.get("expert_parallel_size"), (rollout.get("expert_parallel_size") or 1) == 1,
         1, "the profile models no engine expert parallelism"),
        ("enforce_eager", eager, eager, True, "compiled graphs reorder the engine's arithmetic"),
        ("enable_prefix_caching", cached, not cached, False, "a cached prefix skips the prefill the actor scores"),
        ("enable_chunked_prefill", rollout.get("enable_chunked_prefill"), _budget_prefills_whole_prompts(rollout), False,
         "a prompt split across engine steps is scored as one prefill (or keep it with max_num_batched_tokens >= "
         "max_num_seqs * prompt_length)"),
        ("engine_kwargs.vllm.block_size", block, block == profile.engine.block_size, profile.engine.block_size,
         "the engine's attention tiles by its KV block"),
        ("multi_turn.enable", bool(multi_turn.get("enable", False)), not multi_turn.get("enable", False), False,
         "each turn is prefilled again by the engine, not decoded"),
    )
    for key, value, modelled, want, why in settings:
        if not modelled:
            raise refuse("verl_rollout_setting", key=key, value=value, want=want, why=why, profile=profile.name)
    return check_semantics(rollout, profile)


def check_semantics(rollout, profile) -> Sampling:
    """The logprob verl's rollout returns (``rollout_sampling``), which a profile's own
    ``logprob_semantics``, if set, must give (``verl_logprob_semantics``)."""
    sampling = rollout_sampling(rollout)
    if profile.logprob_semantics is not None:
        asked = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, profile.logprob_semantics)
        if not _same_logprob(asked, sampling):
            raise refuse("verl_logprob_semantics", semantics=profile.logprob_semantics, rollout=sampling.describe())
    return sampling


def record_rollout(original):
    """ActorRolloutRefWorker.__init__: under a real-engine profile, verl's rollout config is checked and
    the logprob it returns recorded for this worker's forwards (every argument passed on as given)."""

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        global _rollout
        profile = state.profile() if state.enabled() else None
        if profile is not None and _is_engine_profile(profile):
            role = "actor" if "actor" in config else "ref"
            model_dtype = ((config.get(role) or {}).get("megatron") or {}).get("dtype")
            _rollout = check_rollout_config(config.rollout, profile, model_dtype)
        elif profile is not None and _reproduces_an_engine(profile):
            _rollout = check_semantics(config.rollout, profile)
        return original(self, config, *args, **kwargs)

    return __init__


def prompt_lengths(batch) -> List[int]:
    """Each sequence's prompt length in verl's micro-batch (as verl's ``no_padding_2_padding`` reads it),
    checked against the unpadded rows; a response the rollout did not decode in one piece is refused."""
    import torch

    prompts, attention = batch["prompts"], batch["attention_mask"]
    if prompts.is_nested:
        prompt = prompts.offsets().diff()
        response = batch["responses"].offsets().diff()
    else:
        width = prompts.shape[1]
        prompt, response = attention[:, :width].sum(dim=1), attention[:, width:].sum(dim=1)
    input_ids = batch["input_ids"]
    rows = input_ids.offsets().diff() if input_ids.is_nested else torch.full_like(prompt, input_ids.shape[1])
    if not torch.equal(rows.cpu(), (prompt + response).cpu()):
        raise refuse("verl_multi_turn_scoring", why="its rows are not prompt + response")
    loss_mask = batch["response_mask"] if "response_mask" in batch.keys() else batch["loss_mask"]
    if not loss_mask.is_nested:
        decoded = torch.arange(loss_mask.shape[1], device=loss_mask.device) < response.to(loss_mask.device)[:, None]
        if not torch.equal(loss_mask.bool(), decoded):
            raise refuse("verl_multi_turn_scoring", why="a response's loss mask has gaps (tool or user turns)")
    return [int(p) for p in prompt.tolist()]


def engine_scored_forward_step(original):
    """MegatronEngineWithLMHead.forward_step inside ``engine_scoring`` (the micro-batch's prompt lengths,
    the Hugging Face vocab) and the rollout's top-k / top-p mask, under a real-engine profile."""

    @functools.wraps(original)
    def forward_step(self, batch_iter, *args, **kwargs):  # every other argument passed on as given
        numerics = ACTIVE.current()
        if numerics is None or not _reproduces_an_engine(numerics.profile):
            return original(self, batch_iter, *args, **kwargs)
        if not _is_engine_profile(numerics.profile):  # an emulated engine: its logprob semantics only
            with state.scoring_sampling(_rollout):  # None (no worker read the rollout): verl's own
                return original(self, batch_iter, *args, **kwargs)
        from ..numerics.vllm.scoring import engine_scoring

        if _rollout is None:
            raise refuse("verl_rollout_unknown")
        batch = next(batch_iter)
        vocab = int(self.model_config.hf_config.vocab_size)
        with engine_scoring(prompt_lengths(batch), vocab), state.scoring_sampling(_rollout):
            return original(self, iter([batch]), *args, **kwargs)

    return forward_step


def register(reg) -> None:
    from ..patching import Patch

    reg.add(Patch(target=VERL_HYBRID_WORKER, replacement=record_rollout, wraps=True, on_import=True,
                  reason="under a real-engine profile verl's rollout settings are checked at the worker's start and "
                         "the logprob its rollout returns (logprobs_mode, T, top-k, top-p) recorded"))
    reg.add(Patch(target=VERL_FORWARD_STEP, replacement=engine_scored_forward_step, wraps=True, on_import=True,
                  reason="verl's actor forward scored as the engine computed the rollout: prompt as prefill, the "
                         "response as decode steps, the rollout's top-k / top-p mask (real-engine profiles)"))
