"""Rollouts for the checker: the reference engine generates responses on rank 0; every rank gets
the token sequences and the engine's logprobs (tensors, no pickle) to score them in any layout."""
import torch
import torch.distributed as dist

from .models.spec import ModelSpec
from .models.weights import SeededWeights
from ..contract.profile import Profile
from ..reference import ReferenceEngine, ReferenceModel, Request
from .batch import ScoringBatch


def make_rollouts(spec: ModelSpec, profile: Profile, dtype, seed: int, num: int, max_new_tokens: int,
                  temperature: float, max_prompt: int, multiple: int, weights=None, prompts=None, device=None,
                  record_modules: bool = False):
    """Returns (ScoringBatch over prompt+response, engine logprobs (b, s) at the scoring positions,
    the engine's module outputs for --bisect on rank 0 (else None)).

    prompts: token-id lists (request i uses prompt i mod len, so N > len samples a group per
    prompt); default: seeded random prompts. weights: default the seeded weights of ``seed``.
    The engine runs on ``device`` (the checker's, so on an NPU it runs the npu kernels too)."""
    gen = torch.Generator().manual_seed(seed + 104729)
    if prompts:
        prompts = [list(prompts[i % len(prompts)]) for i in range(num)]
    else:
        prompt_lens = torch.randint(2, max(3, max_prompt + 1), (num,), generator=gen).tolist()
        prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    prompt_lens = [len(p) for p in prompts]
    total = max(p + max_new_tokens for p in prompt_lens)
    length = -(-total // multiple) * multiple
    tokens = torch.zeros(num, length, dtype=torch.long)
    engine_lp = torch.zeros(num, length, dtype=torch.float32)
    mask = torch.zeros(num, length, dtype=torch.bool)
    if dist.get_rank() == 0:
        model = ReferenceModel.from_source(spec, profile, weights or SeededWeights(spec, seed), dtype)
        if device is not None:
            model.to(device)
        engine = ReferenceEngine(model, seed=seed, max_running=max(1, num // 2 + 1))
        if record_modules:
            tracer = EngineTrace(engine, num, length, spec.num_experts)
            model.trace = tracer
        requests = [Request(prompt=p, max_new_tokens=max_new_tokens, request_id=i, temperature=temperature,
                            arrival_step=i % 3) for i, p in enumerate(prompts)]
        engine.generate(requests)
        for i, r in enumerate(requests):
            seq = r.prompt + r.output
            tokens[i, : len(seq)] = torch.tensor(seq)
            start = len(r.prompt) - 1  # position predicting the first response token
            engine_lp[i, start : start + len(r.output)] = r.logprob_tensor
            mask[i, start : start + len(r.output)] = True
    flags = mask.to(torch.uint8)
    for t in (tokens, engine_lp, flags):
        dist.broadcast(t, src=0)
    mask = flags.bool()
    lengths = [p + max_new_tokens for p in prompt_lens]
    batch = ScoringBatch(tokens=tokens, lengths=lengths, score_mask=mask)
    modules = None
    if record_modules and dist.get_rank() == 0:
        modules = tracer.modules
        modules["logprob"] = (modules["output_layer"][1], engine_lp.reshape(num, length, 1))
        batch.real_mask = tracer.computed  # the engine never runs the last sampled token
    return batch, engine_lp, modules


class EngineTrace:
    """model.trace for --bisect against the rollout engine: scatters each block's rows, whatever
    step (prefill chunk or decode) computed them, to (request, position), token-major like the
    training side's module tensors; router choices become per-token expert masks."""

    def __init__(self, engine, num: int, length: int, num_experts: int):
        self.engine, self.num, self.length, self.num_experts = engine, num, length, num_experts
        self.modules = {}
        self.computed = torch.zeros(num, length, dtype=torch.bool)

    def _place(self, store, rid, pos, rows: torch.Tensor):
        if store is None:
            store = torch.zeros(self.num, self.length, rows.shape[1], dtype=rows.dtype)
        store[rid, pos] = rows
        return store

    def __call__(self, name, inp, out):
        rid = torch.tensor([r for r, _ in self.engine.rows])
        pos = torch.tensor([p for _, p in self.engine.rows])
        if name.endswith(".mlp.router"):  # expert ids (rows, k) -> chosen-expert mask (rows, E)
            chosen = torch.zeros(out.shape[0], self.num_experts, dtype=torch.uint8)
            out = chosen.scatter_(1, out.long(), 1)
        old_in, old_out = self.modules.get(name, (None, None))
        new_in = None if inp is None else self._place(old_in, rid, pos, inp.reshape(inp.shape[0], -1))
        self.modules[name] = (new_in, self._place(old_out, rid, pos, out.reshape(out.shape[0], -1)))
        if name == "embedding":
            self.computed[rid, pos] = True
