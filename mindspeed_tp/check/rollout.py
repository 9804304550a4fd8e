"""Rollouts for the checker: the reference engine generates responses on rank 0; every rank gets
the token sequences and the engine's logprobs (tensors, no pickle) to score them in any layout."""
import torch
import torch.distributed as dist

from ..models.spec import ModelSpec
from ..profile import Profile
from ..reference import ReferenceEngine, ReferenceModel, Request
from .batch import ScoringBatch


def make_rollouts(spec: ModelSpec, profile: Profile, dtype, seed: int, num: int, max_new_tokens: int,
                  temperature: float, max_prompt: int, multiple: int, record_modules: bool = False):
    """Returns (ScoringBatch over prompt+response, engine logprobs (b, s) at the scoring positions)."""
    gen = torch.Generator().manual_seed(seed + 104729)
    prompt_lens = torch.randint(2, max(3, max_prompt + 1), (num,), generator=gen).tolist()
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    total = max(p + max_new_tokens for p in prompt_lens)
    length = -(-total // multiple) * multiple
    tokens = torch.zeros(num, length, dtype=torch.long)
    engine_lp = torch.zeros(num, length, dtype=torch.float32)
    mask = torch.zeros(num, length, dtype=torch.bool)
    if dist.get_rank() == 0:
        model = ReferenceModel.seeded(spec, profile, seed, dtype)
        engine = ReferenceEngine(model, seed=seed, max_running=max(1, num // 2 + 1))
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
    return ScoringBatch(tokens=tokens, lengths=lengths, score_mask=mask), engine_lp, None
