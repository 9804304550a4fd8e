"""verl's actor under a real-engine profile (``integrations/verl_rollout_match.py``, issue #58), against verl
0.9's own config file and batch code: which rollout settings are refused by their verl key, which logprob
the actor then scores, and each micro-batch's prompt lengths. The forward itself inside verl's trainer,
bitwise against the rollout, is the full tier's ``test_verl_e2e.py`` (Ray and vLLM)."""
import os

import pytest
import torch

from mindspeed_tp.contract.profile import load_profile
from mindspeed_tp.errors import ConfigError
from mindspeed_tp.integrations import verl_rollout_match as match

import verl  # the main line's venv has it; conftest leaves this file out where verl is not installed


def verl_rollout_config(**overrides):
    """verl's own default rollout section (its generated Megatron trainer config), as main_ppo reads it."""
    from omegaconf import OmegaConf

    path = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "_generated_ppo_megatron_trainer.yaml")
    config = OmegaConf.load(path)
    config.actor_rollout_ref.rollout.name = "vllm"
    for key, value in overrides.items():
        OmegaConf.update(config, f"actor_rollout_ref.rollout.{key}", value, force_add=True)
    return config.actor_rollout_ref.rollout


# What the README's recipe sets beside verl's defaults for the vllm-cpu-tp1 profile.
RECIPE = {"tensor_model_parallel_size": 1, "enforce_eager": True, "enable_prefix_caching": False,
          "enable_chunked_prefill": False, "temperature": 0.8, "top_p": 0.95}


def refusal(rollout, profile="vllm-cpu-tp1"):
    with pytest.raises(ConfigError) as info:
        match.check_rollout_config(rollout, load_profile(profile))
    return str(info.value)


@pytest.mark.parametrize("key,value,named", [
    ("tensor_model_parallel_size", 2, "actor_rollout_ref.rollout.tensor_model_parallel_size=1"),
    ("enforce_eager", False, "actor_rollout_ref.rollout.enforce_eager=True"),
    ("enable_prefix_caching", True, "actor_rollout_ref.rollout.enable_prefix_caching=False"),
    ("enable_chunked_prefill", True, "actor_rollout_ref.rollout.enable_chunked_prefill=True"),
    ("engine_kwargs.vllm.block_size", 16, "actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=128"),
    ("multi_turn.enable", True, "actor_rollout_ref.rollout.multi_turn.enable=False"),
    ("expert_parallel_size", 2, "actor_rollout_ref.rollout.expert_parallel_size=1"),
    ("name", "sglang", "actor_rollout_ref.rollout.name=vllm"),
    ("logprobs_mode", "processed_logits", "logprobs_mode=processed_logits"),
    ("logprobs_mode", "raw_logprobs", "logprobs_mode=raw_logprobs at temperature 0.8"),
    ("temperature", 0, "temperature > 0"),
])
def test_each_rollout_setting_the_profile_does_not_model_is_refused_by_its_verl_key(key, value, named):
    assert named in refusal(verl_rollout_config(**dict(RECIPE, **{key: value})))


def test_a_rollout_dtype_other_than_the_actors_is_refused():
    rollout = verl_rollout_config(**dict(RECIPE, dtype="float16"))
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.dtype=float16.*rollout.dtype=bfloat16"):
        match.check_rollout_config(rollout, load_profile("vllm-cpu-tp1"), model_dtype="bfloat16")
    match.check_rollout_config(verl_rollout_config(**RECIPE), load_profile("vllm-cpu-tp1"), model_dtype="bf16")


def test_verls_defaults_are_refused_and_the_recipe_is_accepted():
    assert "tensor_model_parallel_size" in refusal(verl_rollout_config())  # verl's default engine TP is 2
    sampling = match.check_rollout_config(verl_rollout_config(**RECIPE), load_profile("vllm-cpu-tp1"))
    # verl's default logprobs_mode (processed_logprobs) at top-p 0.95: the actor applies the rollout's cut
    assert (sampling.semantics, sampling.masks, sampling.scoring_temperature, sampling.top_p) == \
        ("processed", True, 0.8, 0.95)


def test_chunked_prefill_is_accepted_when_the_budget_prefills_every_prompt_whole():
    rollout = verl_rollout_config(**dict(RECIPE, enable_chunked_prefill=True, max_num_seqs=8, prompt_length=32,
                                         max_num_batched_tokens=256))
    match.check_rollout_config(rollout, load_profile("vllm-cpu-tp1"))
    rollout = verl_rollout_config(**dict(RECIPE, enable_chunked_prefill=True, max_num_seqs=8, prompt_length=32,
                                         max_num_batched_tokens=255))
    message = refusal(rollout)
    assert "enable_chunked_prefill=True" in message and "set actor_rollout_ref.rollout.enable_chunked_prefill=False" in message


def test_without_a_cut_the_actor_scores_verls_own_temperature_logprob():
    sampling = match.check_rollout_config(verl_rollout_config(**dict(RECIPE, top_p=1.0)),
                                          load_profile("vllm-cpu-tp1"))
    assert (sampling.masks, sampling.scoring_temperature) == (False, 0.8)
    raw = match.check_rollout_config(verl_rollout_config(**dict(RECIPE, temperature=1.0, logprobs_mode="raw_logprobs")),
                                     load_profile("vllm-cpu-tp1"))
    assert (raw.masks, raw.scoring_temperature) == (False, 1.0)


def test_a_profile_semantics_other_than_the_rollouts_is_refused(tmp_path):
    base = load_profile("vllm-cpu-tp1")
    import dataclasses

    temperature_only = dataclasses.replace(base, logprob_semantics="temperature")
    with pytest.raises(ConfigError, match="logprob_semantics is 'temperature'"):
        match.check_rollout_config(verl_rollout_config(**RECIPE), temperature_only)
    # the same semantics at top-p 1.0: nothing is cut, the two logprobs are one
    match.check_rollout_config(verl_rollout_config(**dict(RECIPE, top_p=1.0)), temperature_only)


def verl_micro_batch(prompt_lens, response_lens, prompt_width=5, response_width=4, response_mask=None):
    """A batch as verl's trainer hands the actor (left-padded prompts, right-padded responses), turned
    into the engine's no-padding form by verl's own ``left_right_2_no_padding``."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    b = len(prompt_lens)
    attention = torch.zeros(b, prompt_width + response_width, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        attention[i, prompt_width - p:prompt_width] = 1
        attention[i, prompt_width:prompt_width + r] = 1
    input_ids = torch.arange(b * (prompt_width + response_width)).view(b, -1) + 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    mask = attention[:, prompt_width:].clone() if response_mask is None else response_mask
    data = TensorDict({"input_ids": input_ids, "attention_mask": attention, "position_ids": position_ids,
                       "prompts": input_ids[:, :prompt_width], "responses": input_ids[:, prompt_width:],
                       "response_mask": mask}, batch_size=[b])
    return left_right_2_no_padding(data)


def test_prompt_lengths_come_from_verls_own_batch():
    batch = verl_micro_batch([5, 2, 3], [4, 1, 3])
    assert match.prompt_lengths(batch) == [5, 2, 3]


def test_a_response_with_gaps_in_its_loss_mask_is_refused():
    gapped = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])  # a tool's output inside the first response
    batch = verl_micro_batch([5, 2], [4, 2], response_mask=gapped)
    with pytest.raises(ConfigError, match="loss mask has gaps"):
        match.prompt_lengths(batch)


_WRAPPED = r'''
import json
import mindspeed_tp
from mindspeed_tp import state
from mindspeed_tp.errors import ConfigError
from omegaconf import OmegaConf
mindspeed_tp.enable("PROFILE")
from verl.workers.engine.megatron import transformer_impl  # (verl's engine_workers needs uvicorn: the e2e's venv)
out = {"wrapped": hasattr(transformer_impl.MegatronEngineWithLMHead.forward_step, "__wrapped__")}

def seen_by_verls_forward(self, batch_iter, *args):
    next(batch_iter)
    mask = state.sampling_mask()
    return None if mask is None else [mask.semantics, mask.top_p]

class Worker:
    pass

class Engine:
    class model_config:
        class hf_config:
            vocab_size = 512

config = OmegaConf.create({"actor": {"megatron": {"dtype": "bfloat16"}}, "rollout": json.loads(ROLLOUT)})
try:  # the wrappers the registry puts on verl's worker __init__ and forward_step, around stand-ins
    from mindspeed_tp.integrations import verl_rollout_match as match
    match.record_rollout(lambda self, config, *a, **k: None)(Worker(), config)
    out["before_forward"] = match.rollout_known()
    out["forward_sees"] = match.engine_scored_forward_step(seen_by_verls_forward)(Engine(), iter([BATCH]), None, None, None)
except ConfigError as e:
    out["refused"] = str(e)
print("OUT " + json.dumps(out))
'''


def run_wrapped(profile, rollout, batch="None"):
    import json

    from conftest import explain, run_python

    code = _WRAPPED.replace("PROFILE", profile).replace("ROLLOUT", repr(json.dumps(rollout))).replace("BATCH", batch)
    proc = run_python(code)
    assert proc.returncode == 0, explain(proc)
    return json.loads(proc.stdout.split("OUT ", 1)[1])


ROLLOUT = {"name": "vllm", "temperature": 0.8, "top_p": 0.95, "top_k": -1, "logprobs_mode": "processed_logprobs",
           "tensor_model_parallel_size": 1, "enforce_eager": True, "enable_prefix_caching": False,
           "enable_chunked_prefill": False, "dtype": "bfloat16"}


def test_under_an_emulated_engines_profile_verls_forward_applies_the_rollouts_cut():
    """rollout-tp1 (a batch-invariant engine, emulated): verl's forward scores with the rollout's top-p cut
    (the reference engine's mask), no scoring plan needed; the forward patch sits on verl's own class."""
    out = run_wrapped("rollout-tp1", ROLLOUT)
    assert out["wrapped"] is True and out["before_forward"] is True
    assert out["forward_sees"] == ["processed", 0.95]
    assert run_wrapped("rollout-tp1", dict(ROLLOUT, top_p=1.0))["forward_sees"] is None  # no cut: verl's own


def test_the_canonical_profile_keeps_verls_own_logprob():
    out = run_wrapped("default", ROLLOUT)
    assert out["before_forward"] is False and out["forward_sees"] is None
