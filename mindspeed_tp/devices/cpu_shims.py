"""Shims: what megatron-core needs to run where it was not written to. Not numerics.

Each shim answers one failure and changes no arithmetic. They come in three groups, each installed
where its condition holds:
- ``no_te_apex``: megatron-core without Transformer Engine or apex (torch norms under SP, names it
  reads from TE without defining them): wherever TE or apex is absent, on any device, the vanilla
  arms included;
- ``gloo``: collectives gloo lacks (an all-gather of uneven sizes): wherever the world runs on gloo
  (each call reads its group's backend, so the group is inert on any other);
- ``cuda_standins``: CUDA-only calls replaced by their CPU equivalents: only in a process without an
  accelerator that runs megatron-core on the CPU on purpose (the checkers' workers, the tests and
  benchmarks, verl's processes under ``mindspeed_tp.verl_cpu``: ``install_cpu_shims``), never by
  ``enable()`` (a user's CPU-only driver, verl's for one, keeps ``Tensor.cuda`` and ``torch.cuda``).
``enable()`` installs the first two (``enable_groups``); the checkers install by condition
(``install_checker_shims``); ``install_cpu_shims`` installs all three. docs/CONTRACT.md,
"megatron-core on CPU", lists the failure each answers.
"""
import contextlib
import functools
import threading

from typing import Callable, List, Optional

import torch

from ..patching import Patch, PatchRegistry

GROUPS = {
    "no_te_apex": PatchRegistry("shims: megatron-core without Transformer Engine / apex"),
    "gloo": PatchRegistry("shims: gloo collectives"),
    "cuda_standins": PatchRegistry("shims: CUDA stand-ins (no accelerator)"),
}
_no_te_apex, _gloo, _cuda = GROUPS["no_te_apex"], GROUPS["gloo"], GROUPS["cuda_standins"]


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


class _NullStream:
    """Stands in for torch.cuda.Stream / Event: synchronisation is a no-op on one CPU stream."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _torch_cuda(name, replacement, reason):
    _cuda.add(Patch(target=f"torch.cuda:{name}", replacement=replacement, reason=reason))


_torch_cuda("current_device", lambda: "cpu", "buffers allocated on torch.cuda.current_device()")
_torch_cuda("get_rng_state", lambda *a, **k: torch.default_generator.get_state(),
            "CudaRNGStatesTracker.add reads the CUDA RNG state")
# default_generator.manual_seed, not torch.manual_seed: the latter calls back into torch.cuda.
_torch_cuda("manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)),
            "model_parallel_cuda_manual_seed seeds the CUDA generator")
_torch_cuda("Stream", _NullStream, "MoE dispatchers create side streams")
_torch_cuda("Event", _NullStream, "MoE dispatchers record events")
_torch_cuda("stream", lambda *a, **k: contextlib.nullcontext(), "torch.cuda.stream(s) context")
_torch_cuda("current_stream", lambda *a, **k: _NullStream(), "stream synchronisation")
_torch_cuda("synchronize", lambda *a, **k: None, "explicit device synchronisation")
_cuda.add(Patch(target="torch:Tensor.cuda", replacement=lambda self, *a, **k: self,
                reason="tied embeddings with PP > 1: LanguageModule moves the shared weight to CUDA "
                       "before all-reducing it between the first and last stage"))


@_cuda.register("megatron.core.tensor_parallel.random:_get_cuda_rng_state",
                "the RNG tracker forks on the CUDA generator; use the CPU one")
def _get_rng_state(*args, **kwargs):
    return torch.default_generator.get_state()


@_cuda.register("megatron.core.tensor_parallel.random:_set_cuda_rng_state",
                "the RNG tracker restores the CUDA generator; use the CPU one")
def _set_rng_state(new_state, *args, **kwargs):
    torch.default_generator.set_state(new_state)


@functools.lru_cache(maxsize=None)
def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


@_cuda.register("megatron.core.transformer.utils:get_default_causal_mask",
                "the default causal mask is built on device='cuda'")
def _get_default_causal_mask(sq: int) -> torch.Tensor:
    return _causal_mask(sq)


@_cuda.register("megatron.core.transformer.utils:get_sliding_window_causal_mask",
                "the sliding-window mask (window_size) is built on device='cuda'", optional=True)
def _get_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    """megatron's mask on the CPU: True hides a key outside [i - left, i + right] (shifted by skv - sq)."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    upper = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


@_no_te_apex.register("megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__",
                      "torch norms assert sequence_parallel=False; a norm is per token, so build it "
                      "without SP and tag its parameters for the SP gradient all-reduce", wraps=True)
def _wrapped_torch_norm_new(original):
    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        import copy

        cfg = copy.copy(config)
        cfg.sequence_parallel = False
        norm = original(cls, cfg, hidden_size, eps, *args, **kwargs)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", True)
        return norm

    return __new__


@_no_te_apex.register("megatron.core.transformer.dot_product_attention:DotProductAttention.__init__",
                      "MLA builds its core attention with Transformer Engine's k_channels / v_channels, which the "
                      "local DotProductAttention lacks (a TypeError on every line): built without them, its "
                      "output sized by the value head", wraps=True)
def _local_attention_head_sizes(original):
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:  # the context it returns is [sq, b, np * dv]
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return __init__


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group=None):
    """megatron's get_pos_emb_on_this_cp_rank (chunks r and 2*CP-1-r of the angle table) with its
    index on the CPU."""
    if cp_group is None:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    size, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[(seq_dim + 1):])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2):])


_cuda.add(Patch(target="megatron.core.models.common.embeddings.rope_utils:get_pos_emb_on_this_cp_rank",
                replacement=_pos_emb_on_this_cp_rank, optional=True,
                reason="context parallelism: the chunk index is built with pin_memory=True and moved to CUDA"))


@_cuda.register("megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
                "only CUDA tensors become host lists/arrays; gloo's all_to_all needs plain split sizes")
def _maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


@_gloo.register("megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
                "gloo's all_gather needs equal sizes: pad uneven splits to the largest and slice",
                wraps=True)
def _gather_along_first_dim(original):
    def gather(input_, group=None, output_split_sizes=None, use_global_buffer=False):
        import torch.distributed as dist

        if output_split_sizes is None or not _on_gloo(group):
            return original(input_, group, output_split_sizes, use_global_buffer)

        sizes = [int(n) for n in output_split_sizes]
        world = len(sizes)
        largest = max(sizes)
        padded = input_.new_zeros((largest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((world * largest, *input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        parts = out.reshape(world, largest, *input_.shape[1:])
        return torch.cat([parts[i, : sizes[i]] for i in range(world)], dim=0)

    return gather


def _on_gloo(group) -> bool:
    import torch.distributed as dist

    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return dist.get_backend(group) == "gloo"


class _CudaAsCpu(torch.overrides.TorchFunctionMode):
    """While a shimmed megatron-core function runs: tensors it allocates with ``device='cuda'``
    (or a CUDA device) are allocated on the CPU, and ``Tensor.type()`` names a CPU tensor by its
    CUDA type string (``torch.cuda.FloatTensor``), which megatron's optimizers require. Every other
    call passes through unchanged: no arithmetic differs."""

    _active = threading.local()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and _names_cuda(device):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _names_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda")


def _cuda_as_cpu(original):
    """Wrap ``original`` so that it runs under _CudaAsCpu (entered once, also when nested)."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if getattr(_CudaAsCpu._active, "on", False):
            return original(*args, **kwargs)
        _CudaAsCpu._active.on = True
        try:
            with _CudaAsCpu():
                return original(*args, **kwargs)
        finally:
            _CudaAsCpu._active.on = False

    return wrapper


_OPT = "megatron.core.optimizer"
_CUDA_AS_CPU = (
    (f"{_OPT}.optimizer:MixedPrecisionOptimizer.__init__",
     "allocates found_inf / the overflow buffer / scale one with torch.tensor(..., device='cuda')"),
    (f"{_OPT}.optimizer:Float16OptimizerWithFloat16Params.__init__",
     "accepts only parameters whose type() is torch.cuda.{Half,BFloat16,Float}Tensor"),
    (f"{_OPT}.optimizer:FP32Optimizer.__init__", "allocates its loss scale with device='cuda'"),
    (f"{_OPT}.distrib_optimizer:DistributedOptimizer.__init__",
     "refuses parameters whose type() is not torch.cuda.*Tensor (building its main-param groups)"),
    (f"{_OPT}.clip_grads:get_grad_norm_fp32", "the total norm and overflow buffer are allocated on device='cuda'"),
    (f"{_OPT}.clip_grads:clip_grad_by_total_norm_fp32",
     "asserts param.grad.type() == 'torch.cuda.FloatTensor'; overflow buffer on device='cuda'"),
    (f"{_OPT}.clip_grads:count_zeros_fp32", "the zero count is allocated on device='cuda'"),
    ("megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining",
     "the token count is allocated on device='cuda'"),
    ("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving",
     "the token count is allocated on the CUDA device"),
    ("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving",
     "the token count is allocated on the CUDA device"),
)
# Only in some megatron-core lines (skipped where absent).
_CUDA_AS_CPU_OPTIONAL = (
    (f"{_OPT}.optimizer:MegatronOptimizer.has_grad_norm_group",
     "0.19: the separate-grad-norm-group flag is allocated on device='cuda' (every step of ChainedOptimizer)"),
)
for _target, _why in _CUDA_AS_CPU:
    _cuda.add(Patch(target=_target, replacement=_cuda_as_cpu, wraps=True,
                    reason=_why + ": allocate on the CPU and name CPU tensors by their CUDA type while it runs"))
for _target, _why in _CUDA_AS_CPU_OPTIONAL:
    _cuda.add(Patch(target=_target, replacement=_cuda_as_cpu, wraps=True, optional=True,
                    reason=_why + ": allocate on the CPU and name CPU tensors by their CUDA type while it runs"))


@_no_te_apex.register("megatron.core.fp8_utils:quantize_param_shard",
                      "0.12.x without Transformer Engine: the distributed optimizer calls it after every step with no "
                      "FP8 parameters and the fallback raises anyway; nothing to quantize is a no-op (as in 0.16)",
                      wraps=True)
def _quantize_param_shard(original):
    def quantize_param_shard(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return original(model_params, *args, **kwargs)

    return quantize_param_shard


# megatron-core 0.16 reads this name without defining it when Transformer Engine is absent.
_no_te_apex.add(Patch(target="megatron.core.transformer.moe.moe_utils:te_general_gemm", replacement=None,
                      define_if_absent=True, reason="megatron-core 0.16 MoE router gating reads te_general_gemm "
                      "(Transformer Engine) without defining it when TE is absent"))

# megatron-core 0.16's MLA imports megatron's TE extension, which imports without TE and leaves
# TELinear a mock: MLA's isinstance(linear_proj, TELinear) then fails at construction.
_no_te_apex.add(Patch(target="megatron.core.transformer.multi_latent_attention:HAVE_TE",
                      replacement=_importable("transformer_engine"), optional=True, everywhere=False,
                      reason="megatron-core 0.16's MLA believes Transformer Engine present when it is absent "
                      "(its TELinear a mock: isinstance fails at construction)"))


# Providers of the registries the shims go under: the switch registers the numerics patches'.
_above: List[Callable[[], PatchRegistry]] = []


def keep_under(provider: Callable[[], PatchRegistry]) -> None:
    """Shims installed later go under ``provider()``'s patches."""
    if provider not in _above:
        _above.append(provider)


def install_shims(*names: str) -> None:
    """Install the named groups (idempotent). Shims go under the registries of ``keep_under`` (the
    numerics patches): where a shim's target is also one of their targets that is applied, those
    patches are lifted and put back on top, so disable() still restores the shimmed original."""
    groups = [GROUPS[n] for n in names]
    pending = {p.target for g in groups for p in g.patches if not p.applied}
    lifted = [r for r in (provider() for provider in _above) if pending & {p.target for p in r.patches if p.applied}]
    for registry in lifted:
        registry.revert()
    for group in groups:
        group.apply()
    for registry in reversed(lifted):
        registry.apply()


def install_cpu_shims() -> None:
    """Every group: a machine without an accelerator (megatron-core on CPU, gloo, no TE or apex)."""
    install_shims(*GROUPS)


def needed_groups(backend: Optional[str]) -> List[str]:
    """The groups whose condition holds in this process, for a world on ``backend`` (None: none)."""
    from . import accelerator_available

    names = []
    if not (_importable("transformer_engine") and _importable("apex")):
        names.append("no_te_apex")
    if backend == "gloo":
        names.append("gloo")
    if not accelerator_available():
        names.append("cuda_standins")
    return names


def enable_groups() -> List[str]:
    """The groups ``enable()`` installs in any process: megatron-core without TE/apex and the gloo
    collectives (inert off gloo, and the world may not exist yet). Never the CUDA stand-ins."""
    return [name for name in needed_groups("gloo") if name != "cuda_standins"]


def install_checker_shims() -> List[str]:
    """What a checker's worker needs, by condition (the world's backend read from torch.distributed);
    returns the groups installed."""
    import torch.distributed as dist

    names = needed_groups(dist.get_backend() if dist.is_initialized() else None)
    install_shims(*names)
    return names


def remove_shims(*names: str) -> None:
    """Remove the named groups (``*GROUPS``: all of them)."""
    for name in reversed(names):
        GROUPS[name].revert()


class _AllGroups:
    """The three groups as one listing (``applied``: any of them is)."""

    @property
    def patches(self) -> list:
        return [p for g in GROUPS.values() for p in g.patches]

    def entries(self) -> list:
        return [e for g in GROUPS.values() for e in g.entries()]

    @property
    def applied(self) -> bool:
        return any(g.applied for g in GROUPS.values())


def shim_registry() -> _AllGroups:
    return _AllGroups()
