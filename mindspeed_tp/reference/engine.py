"""A rollout-engine stand-in: paged KV cache, chunked prefill, one-token decode, continuous
batching, greedy or temperature sampling (top-k / top-p optional) from per-request seeded generators.

It runs ``ReferenceModel`` and so the same numerics contract as the patched training forward: a
request's tokens and logprobs depend on nothing but the request (not on the other requests in
the batch, their number, order, or when they joined).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from ..contract.sampling import Sampling
from ..kernels import mask_padded_vocab
from ..kernels.sampling import divide_by_temperature, mask_dropped_vocab, reference_mask
from .model import ReferenceModel


@dataclass
class Request:
    prompt: List[int]
    max_new_tokens: int
    request_id: int = 0
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1: off
    arrival_step: int = 0     # continuous batching: the step at which the request joins
    eos_token_id: Optional[int] = None  # stop after sampling this token (it is part of the output)
    # filled by the engine
    output: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    logprob_tensor: Optional[torch.Tensor] = None

    @property
    def done(self) -> bool:
        stopped = self.eos_token_id is not None and bool(self.output) and self.output[-1] == self.eos_token_id
        return stopped or len(self.output) >= self.max_new_tokens


class PagedKVCache:
    """Per-layer pools of fixed-size pages; each request owns a list of pages."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, groups: int, head_dim: int, dtype,
                 device=None, value_head_dim: Optional[int] = None):
        self.page_size = page_size
        self.k = torch.zeros(num_layers, num_pages, page_size, groups, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(num_layers, num_pages, page_size, groups, value_head_dim or head_dim, dtype=dtype,
                             device=device)
        self.free = list(range(num_pages))
        self.tables: Dict[int, List[int]] = {}
        self.lengths: Dict[int, int] = {}

    def reserve(self, rid: int, length: int) -> None:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.page_size < length:
            if not self.free:
                raise RuntimeError("KV cache is full: raise num_pages")
            table.append(self.free.pop())

    def write(self, layer: int, rid: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        table = self.tables[rid]
        for i in range(k.shape[0]):
            page, offset = divmod(start + i, self.page_size)
            self.k[layer, table[page], offset] = k[i]
            self.v[layer, table[page], offset] = v[i]

    def read(self, layer: int, rid: int, length: int):
        """The layer's page pools, the request's page ids (in order) and its key count."""
        return self.k[layer], self.v[layer], torch.tensor(self.tables[rid], device=self.k.device), length

    def release(self, rid: int) -> None:
        self.free.extend(self.tables.pop(rid, []))


def _request_generator(seed: int, request_id: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()[:8]
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


class ReferenceEngine:
    def __init__(self, model: ReferenceModel, page_size: int = 16, num_pages: int = 4096, max_running: int = 8,
                 prefill_chunk: int = 64, seed: int = 0, logprob_semantics: str = "temperature"):
        """logprob_semantics: which logprob of each sampled token is returned (contract/sampling.py)."""
        spec = model.spec
        self.model, self.max_running, self.prefill_chunk, self.seed = model, max_running, prefill_chunk, seed
        self.logprob_semantics = logprob_semantics
        # MLA caches each head's up-projected key and value (its latent cache is a later optimisation)
        self.cache = PagedKVCache(spec.num_layers, num_pages, page_size, spec.attention_heads_kv, spec.kv_channels,
                                  model.dtype, model.device, spec.value_head_dim)
        self.rows = []  # (request_id, position) of each row of the current step (for model.trace)

    def _sample(self, logits: torch.Tensor, req: Request, gen: torch.Generator):
        m = self.model
        sampling = Sampling(req.temperature, req.top_k, req.top_p, self.logprob_semantics)
        masked = mask_padded_vocab(logits, m.spec.vocab_size)
        if sampling.greedy:
            token = int(torch.argmax(masked))  # first maximum: lowest id on ties
        else:
            scaled = divide_by_temperature(masked, sampling.temperature)
            if sampling.filters:  # sampled from what top-k / top-p keep of the real vocab
                scaled = mask_dropped_vocab(scaled, None, m.spec.vocab_size, reference_mask(sampling))
            probs = torch.softmax(scaled, dim=-1)
            token = int(torch.multinomial(probs.cpu(), 1, generator=gen))  # the request's CPU generator
        lp = m.logprob(logits.unsqueeze(0), torch.tensor([token], device=logits.device), sampling)[0].cpu()
        return token, lp

    def generate(self, requests: List[Request]) -> List[Request]:
        """Run all requests to completion with continuous batching; fills output/logprobs."""
        waiting = sorted(requests, key=lambda r: (r.arrival_step, r.request_id))
        running: List[Request] = []
        progress: Dict[int, int] = {}
        gens = {r.request_id: _request_generator(self.seed, r.request_id) for r in requests}
        lps: Dict[int, List[torch.Tensor]] = {r.request_id: [] for r in requests}
        step = 0
        while waiting or running:
            while waiting and len(running) < self.max_running and waiting[0].arrival_step <= step:
                req = waiting.pop(0)
                running.append(req)
                progress[req.request_id] = 0
            if not running:
                step += 1
                continue
            tokens, positions, segments, owners = [], [], [], []
            for req in running:
                done = progress[req.request_id]
                seq = req.prompt + req.output
                if done < len(req.prompt):
                    new = seq[done : min(len(req.prompt), done + self.prefill_chunk)]
                else:
                    new = seq[done:]
                start = len(tokens)
                tokens += new
                positions += list(range(done, done + len(new)))
                segments.append((start, len(tokens)))
                owners.append((req, done))
                self.cache.reserve(req.request_id, done + len(new))

            def writer(layer, seg, k, v):
                req, done = owners[seg]
                self.cache.write(layer, req.request_id, done, k, v)

            def reader(layer, seg):
                req, done = owners[seg]
                stop = segments[seg][1] - segments[seg][0]
                return self.cache.read(layer, req.request_id, done + stop)

            self.rows = [(req.request_id, pos) for (req, _), (start, stop) in zip(owners, segments)
                         for pos in range(progress[req.request_id], progress[req.request_id] + stop - start)]
            device = self.model.device
            logits = self.model.forward(torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                                        segments, writer, reader)
            still = []
            for seg, (req, done) in enumerate(owners):
                start, stop = segments[seg]
                progress[req.request_id] = done + (stop - start)
                if progress[req.request_id] >= len(req.prompt):  # prompt consumed: sample a token
                    token, lp = self._sample(logits[stop - 1], req, gens[req.request_id])
                    req.output.append(token)
                    lps[req.request_id].append(lp)
                if req.done:
                    self.cache.release(req.request_id)
                else:
                    still.append(req)
            running = still
            step += 1
        for req in requests:
            req.logprob_tensor = torch.stack(lps[req.request_id]) if lps[req.request_id] else torch.zeros(0)
            req.logprobs = req.logprob_tensor.tolist()
        return requests
