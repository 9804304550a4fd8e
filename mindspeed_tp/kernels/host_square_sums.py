"""The exact norm's per-exponent sums of squares on the host, as one C loop (``grad_norm``'s CPU path).

As torch operations the accumulation is about 18 passes over every chunk plus two integer
scatter-adds: ~60x ``torch.linalg.vector_norm`` on one CPU thread. This loop reads each fp32 value
once and adds its exact square m^2 (< 2^48) to the int64 bin of its exponent, four bin copies
against store-to-load stalls, then splits each bin's block sum into the same 24-bit halves the
torch path uses. Integer sums are exact, so both paths give the same total, the same bits.

The source is compiled on first use with the system C compiler (``$CC``, else ``cc``) at ``-O3``
without ``-march`` (the library may be shared between machines of different ISAs through the cache
directory), cached by a hash of the source, the flags, the compiler and the machine type under
``$MINDSPEED_TP_CACHE_DIR`` (default ``~/.cache/mindspeed_tp``). No compiler, or a failed compile:
one warning, and the torch path runs (same bits, slower). ``MINDSPEED_TP_HOST_KERNELS=0`` selects
the torch path.
"""
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from typing import Optional

import torch

MAX_ELEMENTS = 1 << 22  # per call: the adds to one accumulator stay below 2^22 * 2^24 = 2^46

_FLAGS = ["-O3", "-funroll-loops", "-shared", "-fPIC"]
_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* The square of one value into its exponent's bin of copy h; NaN and inf land in bin 255, which
   only tells that the block is rescanned for them (rare: no branch in the loop). */
#define ADD(h, u) do {                                                              \
        uint32_t e_ = ((u) >> 23) & 0xFFu, f_ = (u) & 0x7FFFFFu;                    \
        uint64_t m_ = e_ ? (f_ | 0x800000u) : f_;                                   \
        (h)[e_] += m_ * m_;                                                         \
    } while (0)

/* hi, lo: the int64 accumulators of bins 0..254 (biased exponents; subnormals go to bin 1);
   *nan / *inf set to 1 when a NaN / an inf is met. n <= 2^22. */
void exact_square_sums_f32(const uint32_t *bits, int64_t n, int64_t *hi, int64_t *lo, int64_t *nan, int64_t *inf) {
    enum { BLOCK = 1 << 14 };  /* a bin copy sums < 2^12 squares < 2^48: < 2^60 */
    uint64_t h[4][256];  /* four copies: consecutive values (often one exponent) do not wait on one store */
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t end = start + BLOCK < n ? start + BLOCK : n, i = start;
        memset(h, 0, sizeof h);
        for (; i + 4 <= end; i += 4) {
            ADD(h[0], bits[i]); ADD(h[1], bits[i + 1]); ADD(h[2], bits[i + 2]); ADD(h[3], bits[i + 3]);
        }
        for (; i < end; ++i) ADD(h[0], bits[i]);
        if (h[0][255] | h[1][255] | h[2][255] | h[3][255])  /* a square of exponent 255 is >= 2^46 */
            for (i = start; i < end; ++i)
                if (((bits[i] >> 23) & 0xFFu) == 0xFFu) { if (bits[i] & 0x7FFFFFu) *nan = 1; else *inf = 1; }
        for (int e = 0; e < 255; ++e) {
            uint64_t s = h[0][e] + h[1][e] + h[2][e] + h[3][e];  /* < 2^62 */
            if (!s) continue;
            int b = e ? e : 1;
            hi[b] += (int64_t)(s >> 24);
            lo[b] += (int64_t)(s & 0xFFFFFFu);
        }
    }
}
"""


def _compiler() -> Optional[str]:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or next((shutil.which(c) for c in ("gcc", "clang") if shutil.which(c)), None)


def _cache_dir() -> str:
    return os.environ.get("MINDSPEED_TP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mindspeed_tp")


def _build(cc: str) -> str:
    key = hashlib.sha256("\0".join([_SOURCE, " ".join(_FLAGS), os.path.realpath(cc), platform.machine()]).encode())
    directory = _cache_dir()
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        directory = tempfile.mkdtemp(prefix="mindspeed_tp_")
    target = os.path.join(directory, f"host_square_sums-{key.hexdigest()[:16]}.so")
    if os.path.exists(target):
        return target
    # Each process compiles to its own file and renames it into place: ranks starting together race safely.
    fd, source = tempfile.mkstemp(suffix=".c", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(_SOURCE)
    built = source[:-2] + ".so"
    try:
        subprocess.run([cc, *_FLAGS, "-o", built, source], check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, target)
    finally:
        for leftover in (source, built):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """The compiled loop, or None (the torch path runs: same bits, slower)."""
    if os.environ.get("MINDSPEED_TP_HOST_KERNELS", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        warnings.warn("mindspeed-tp: no C compiler (set CC) for the exact gradient norm's host loop; it runs as "
                      "torch operations instead (the same bits, ~10x slower on CPU)", RuntimeWarning, stacklevel=2)
        return None
    try:
        lib = ctypes.CDLL(_build(cc))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        warnings.warn(f"mindspeed-tp: compiling the exact gradient norm's host loop with {cc} failed ({detail.strip()[-300:]}); "
                      "it runs as torch operations instead (the same bits, ~10x slower on CPU)", RuntimeWarning, stacklevel=2)
        return None
    lib.exact_square_sums_f32.restype = None
    lib.exact_square_sums_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4
    return lib


def add_square_sums(lib: ctypes.CDLL, acc: torch.Tensor, chunk: torch.Tensor, nan_bin: int, inf_bin: int) -> None:
    """Adds the squares of ``chunk`` (fp32, host, at most ``MAX_ELEMENTS``) to ``acc`` (int64 (2, bins),
    host, contiguous) as ``grad_norm._add_chunk`` does; ``acc[0, nan_bin]`` / ``acc[0, inf_bin]`` become
    1 when a NaN / an inf is met."""
    assert chunk.dtype == torch.float32 and chunk.device.type == "cpu" and chunk.numel() <= MAX_ELEMENTS
    assert acc.dtype == torch.int64 and acc.device.type == "cpu" and acc.is_contiguous() and acc.dim() == 2
    chunk = chunk.contiguous()
    base, row, word = acc.data_ptr(), acc.stride(0) * 8, 8
    lib.exact_square_sums_f32(chunk.data_ptr(), chunk.numel(), base, base + row,
                              base + nan_bin * word, base + inf_bin * word)
