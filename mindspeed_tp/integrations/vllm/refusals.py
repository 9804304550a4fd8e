"""Settings under which the real engine's arithmetic is not the one a ``vllm-cpu-*`` profile
describes: refused by name (ConfigError), never run with a silent mismatch."""
from __future__ import annotations

from typing import Mapping, Optional

from ...contract.refusals import refuse

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
        raise refuse("vllm_missing")
    installed = installed.split("+")[0]
    allowed = _versions(version_spec)
    if installed not in allowed:
        raise refuse("vllm_version", installed=installed, allowed=sorted(allowed), first=allowed[0])
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
        raise refuse("vllm_split_kv_threads", threads=threads or "unset")
    if env.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        raise refuse("vllm_batch_invariant")
    if prefix_caching:
        raise refuse("vllm_prefix_caching")
    if not enforce_eager:
        raise refuse("vllm_not_eager")
    if tp < 1 or tp & (tp - 1):
        raise ValueError(f"engine tensor_parallel_size={tp}: use a power of two")


def check_head_dim(head_dim: int) -> None:
    """The head size must be one the installed vLLM's CPU attention backend supports (asked from it):
    vllm-cpu 0.32 starts with head_dim 16 and dies in its kernel on AVX-512 hosts."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if not CPUAttentionBackend.supports_head_size(int(head_dim)):
        raise refuse("vllm_head_dim", head_dim=head_dim, supported=CPUAttentionBackend.get_supported_head_sizes())
