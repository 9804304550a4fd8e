"""The x86 instruction sets this CPU offers, as the libraries that choose code by them name them.

oneDNN (``ONEDNN_MAX_CPU_ISA``), MKL (``MKL_ENABLE_INSTRUCTIONS``), ATen's vector loops and vLLM's CPU
kernels each pick code per ISA; mindspeed-tp's kernels are built so that no such choice changes a bit
(``kernels/backends/torch.py``, ``kernels/elementwise.py``), and where an engine's kernels are modelled
for some ISAs only, the profile refuses the others by name (``numerics/vllm``). Detected from
``/proc/cpuinfo``'s flags, never assumed.
"""
from __future__ import annotations

import functools
from typing import Dict, FrozenSet, List, Tuple


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> Dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty off Linux)."""
    fields: Dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the end of the first processor's block
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> FrozenSet[str]:
    """The ``flags`` of /proc/cpuinfo's first processor (empty off Linux or off x86)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_model() -> str:
    return _cpuinfo().get("model name", "unknown CPU")


# (oneDNN's ISA limit, MKL's instruction limit, the cpuinfo flags the level needs), lowest first.
ISA_LEVELS: Tuple[Tuple[str, str, FrozenSet[str]], ...] = (
    ("AVX2", "AVX2", frozenset({"avx2", "fma"})),
    ("AVX512_CORE", "AVX512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    ("AVX512_CORE_BF16", "AVX512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})),
    ("AVX512_CORE_AMX", "AVX512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                                             "amx_tile", "amx_bf16"})),
)


def isa_levels(flags: FrozenSet[str] = None) -> List[Tuple[str, str]]:
    """(ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) of every level this CPU can run, lowest first: the
    limits under which one host can run the code paths of every CPU below it."""
    flags = cpu_flags() if flags is None else flags
    return [(onednn, mkl) for onednn, mkl, needs in ISA_LEVELS if needs <= flags]


def describe(flags: FrozenSet[str] = None) -> str:
    """The CPU and the ISA features the libraries choose by, for messages and reports."""
    flags = cpu_flags() if flags is None else flags
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return f"{cpu_model()} ({' '.join(isa) or 'no x86 ISA flags'})"
