"""The exact norm's per-exponent sums of squares on the host, as compiled C (``grad_norm``'s CPU path).

As torch operations the accumulation is about 18 passes over every chunk plus two integer
scatter-adds: ~60x ``torch.linalg.vector_norm`` on one CPU thread. Here each fp32 value is read
once and its exact square m^2 (< 2^48) is added to integer sums, two ways:

- **windowed** (x86 with AVX2 or AVX-512): a block of 2^13 values whose nonzero exponents all lie in
  a window of 24 binades [low, low + 23] adds m^2 * 4^(E - low) (below 2^94) for each value to three
  64-bit vector lanes of 32-bit limbs -- no scatter, no branch, one pass. The window is the previous
  block's; a block outside it (a value above or below, subnormals included; zeros add nothing) is
  summed again in a window ending one binade above its own largest exponent, and a block that fits
  none (it spans more than 23 binades, or holds a NaN / inf) runs the histogram. Gradients rarely span
  23 binades inside 2^13 neighbours, so nearly every block is windowed, once.
- **histogram** (other CPUs, and the blocks above): each m^2 to the int64 bin of its exponent, four
  bin copies against store-to-load stalls.

Both end in the same (hi, lo) 24-bit halves per bin the torch path uses (2^32 units of bin E are one
unit of bin E + 16). Integer sums are exact, so every path gives the same total, the same bits.

The source is compiled on first use with the system C compiler (``$CC``, else ``cc``) at ``-O3
-march=native`` (the windowed path needs the host's vector ISA; a compiler refusing the flag builds
without it, histogram only), cached by a hash of the source, the flags, the compiler and the CPU's
feature flags under ``$MINDSPEED_TP_CACHE_DIR`` (default ``~/.cache/mindspeed_tp``): machines of
other ISAs sharing the directory build their own. No compiler, or a failed compile: one warning,
and the torch path runs (same bits, slower). ``MINDSPEED_TP_HOST_KERNELS=0`` selects the torch path.
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
MIN_BINS = 264  # the windowed path writes up to bin 254 + 9 (the accumulators' headroom)
WINDOW_BLOCK, WINDOW_SPAN = 1 << 13, 24  # the windowed path's block and binades (substituted into _SOURCE)

_FLAGS = ["-O3", "-funroll-loops", "-shared", "-fPIC"]
_NATIVE = "-march=native"
_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && (defined(__AVX512F__) || defined(__AVX2__))
#include <immintrin.h>
#define WINDOWED 1
#else
#define WINDOWED 0
#endif

/* The square of one value into its exponent's bin of copy h; NaN and inf land in bin 255, which
   only tells that the block is rescanned for them (rare: no branch in the loop). */
#define ADD(h, u) do {                                                              \
        uint32_t e_ = ((u) >> 23) & 0xFFu, f_ = (u) & 0x7FFFFFu;                    \
        uint64_t m_ = e_ ? (f_ | 0x800000u) : f_;                                   \
        (h)[e_] += m_ * m_;                                                         \
    } while (0)

/* s (< 2^62) units of bin b: its 24-bit halves */
static inline void add_units(int64_t *hi, int64_t *lo, int b, uint64_t s) {
    hi[b] += (int64_t)(s >> 24);
    lo[b] += (int64_t)(s & 0xFFFFFFu);
}

/* n <= 2^14 values by bins of their exponents (subnormals to bin 1) */
static void histogram(const uint32_t *bits, int64_t n, int64_t *hi, int64_t *lo, int64_t *nan, int64_t *inf) {
    uint64_t h[4][256];  /* four copies: consecutive values (often one exponent) do not wait on one store */
    int64_t i = 0;       /* a bin copy sums < 2^12 squares < 2^48: < 2^60 */
    memset(h, 0, sizeof h);
    for (; i + 4 <= n; i += 4) {
        ADD(h[0], bits[i]); ADD(h[1], bits[i + 1]); ADD(h[2], bits[i + 2]); ADD(h[3], bits[i + 3]);
    }
    for (; i < n; ++i) ADD(h[0], bits[i]);
    if (h[0][255] | h[1][255] | h[2][255] | h[3][255])  /* a square of exponent 255 is >= 2^46 */
        for (i = 0; i < n; ++i)
            if (((bits[i] >> 23) & 0xFFu) == 0xFFu) { if (bits[i] & 0x7FFFFFu) *nan = 1; else *inf = 1; }
    for (int e = 0; e < 255; ++e) {
        uint64_t s = h[0][e] + h[1][e] + h[2][e] + h[3][e];  /* < 2^62 */
        if (s) add_units(hi, lo, e ? e : 1, s);
    }
}

#if WINDOWED
#if defined(__AVX512F__)
#define VBYTES 64
#else
#define VBYTES 32
#endif
typedef uint32_t u32v __attribute__((vector_size(VBYTES)));
typedef uint64_t u64v __attribute__((vector_size(VBYTES)));
enum { BLOCK = @WINDOW_BLOCK@, LANES = VBYTES / 4, SPAN = @WINDOW_SPAN@ };

static inline u64v square(u64v m) {  /* m < 2^24 in each lane's low half: one 32 x 32 -> 64-bit product */
#if defined(__AVX512F__)
    return (u64v)_mm512_mul_epu32((__m512i)m, (__m512i)m);
#else
    return (u64v)_mm256_mul_epu32((__m256i)m, (__m256i)m);
#endif
}

/* m^2 4^(s/2) (s <= 46: below 2^94) as three 32-bit limbs added to c0, c1, c2 */
static inline void accumulate(u64v m, u64v s, u64v *c0, u64v *c1, u64v *c2) {
    u64v sq = square(m), v = sq << s;  /* v: bits 0..63 */
    *c0 += v & 0xFFFFFFFFu;
    *c1 += v >> 32;
    *c2 += (sq >> 16) >> (48 - s);     /* bits 64..95 (48 - s >= 2: no shift by the width) */
}

/* Sums the block when every nonzero value's exponent lies in [low, low + SPAN): returns 0; else adds
   nothing and returns 1. */
static int windowed(const uint32_t *b, int64_t n, uint32_t low, int64_t *hi, int64_t *lo) {
    const int64_t vn = n & ~(int64_t)(LANES - 1);
    u64v c0 = {0}, c1 = {0}, c2 = {0};
    u32v miss = {0};
    for (int64_t i = 0; i < vn; i += LANES) {
        u32v u;
        memcpy(&u, b + i, sizeof u);
        u32v e = (u >> 23) & 0xFF, d = e - low;
        u32v in = (u32v)(d < SPAN);                  /* all ones inside the window */
        miss |= ~in & (u & 0x7FFFFFFF);              /* outside it and not a zero */
        u32v m = ((u & 0x7FFFFF) | 0x800000) & in;
        u32v s = (d << 1) & in;
        u64v m2 = (u64v)m, s2 = (u64v)s;             /* the even and odd 32-bit lanes: low and high halves */
        accumulate(m2 & 0xFFFFFFFFu, s2 & 0xFFFFFFFFu, &c0, &c1, &c2);
        accumulate(m2 >> 32, s2 >> 32, &c0, &c1, &c2);
    }
    uint32_t any = 0;
    for (int j = 0; j < LANES; ++j) any |= miss[j];
    for (int64_t i = vn; i < n; ++i) {               /* the tail, the same tests */
        uint32_t e = (b[i] >> 23) & 0xFFu;
        if (e - low >= SPAN) any |= b[i] & 0x7FFFFFFFu;
    }
    if (any) return 1;
    uint64_t s0 = 0, s1 = 0, s2 = 0;                 /* a lane sums <= 2^11 limbs < 2^32: < 2^45 over the lanes */
    for (int j = 0; j < LANES / 2; ++j) { s0 += c0[j]; s1 += c1[j]; s2 += c2[j]; }
    for (int64_t i = vn; i < n; ++i) {
        uint32_t u = b[i], e = (u >> 23) & 0xFFu;
        if (e - low >= SPAN) continue;               /* a zero */
        uint64_t m = (u & 0x7FFFFFu) | 0x800000u, sq = m * m;
        unsigned s = 2 * (e - low);
        uint64_t v = sq << s;
        s0 += v & 0xFFFFFFFFu; s1 += v >> 32; s2 += (sq >> 16) >> (48 - s);
    }
    /* units of bin low; 2^32 units of bin E are one of bin E + 16 (bins up to 254 + 9: the headroom) */
    if (s0) add_units(hi, lo, (int)low, s0);
    if (s1) add_units(hi, lo, (int)low + 16, s1);
    if (s2) add_units(hi, lo, (int)low + 32, s2);
    return 0;
}

/* the window for a block whose largest exponent is (about) top: up to one binade above it, so
   that a neighbour's slightly larger maximum still fits; 0 when it would reach below bin 2 */
static uint32_t window_low(uint32_t top) {
    uint32_t high = top < 254 ? top + 1 : 254;
    return high >= SPAN + 1 ? high - (SPAN - 1) : 0;
}
#else
enum { BLOCK = 1 << 14 };
#endif

/* hi, lo: the int64 accumulators (bins 1..254 by biased exponent, the headroom above them);
   *nan / *inf set to 1 when a NaN / an inf is met. n <= 2^22. */
void exact_square_sums_f32(const uint32_t *bits, int64_t n, int64_t *hi, int64_t *lo, int64_t *nan, int64_t *inf) {
#if WINDOWED
    uint32_t low = 0;  /* the window that fitted the previous block (0: none yet) */
#endif
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t len = start + BLOCK < n ? BLOCK : n - start;
#if WINDOWED
        /* one pass in the previous block's window; when it does not fit, this block's own */
        if (low && !windowed(bits + start, len, low, hi, lo)) continue;
        uint32_t top = 0;
        for (int64_t i = 0; i < len; ++i) { uint32_t e = bits[start + i] & 0x7F800000u; top = e > top ? e : top; }
        top >>= 23;
        uint32_t tried = low;
        low = top == 255 ? 0 : window_low(top);
        if (low && low != tried && !windowed(bits + start, len, low, hi, lo)) continue;
#endif
        histogram(bits + start, len, hi, lo, nan, inf);
    }
}

/* 1 when the windowed path was compiled (this CPU has AVX2 or AVX-512) */
int exact_square_sums_windowed(void) { return WINDOWED; }

/* the histogram alone (tests compare both paths' accumulators) */
void exact_square_sums_f32_histogram(const uint32_t *bits, int64_t n, int64_t *hi, int64_t *lo, int64_t *nan, int64_t *inf) {
    for (int64_t start = 0; start < n; start += 1 << 14)
        histogram(bits + start, start + (1 << 14) < n ? 1 << 14 : n - start, hi, lo, nan, inf);
}
""".replace("@WINDOW_BLOCK@", str(WINDOW_BLOCK)).replace("@WINDOW_SPAN@", str(WINDOW_SPAN))


def _compiler() -> Optional[str]:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or next((shutil.which(c) for c in ("gcc", "clang") if shutil.which(c)), None)


def _cache_dir() -> str:
    return os.environ.get("MINDSPEED_TP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mindspeed_tp")


def _cpu_features() -> str:
    """The host CPU's feature flags (what ``-march=native`` compiles for): part of the cache key."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in ("flags", "Features"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _build(cc: str, march: str = _NATIVE) -> str:
    key = hashlib.sha256("\0".join([_SOURCE, " ".join(_FLAGS), march, os.path.realpath(cc), platform.machine(),
                                    _cpu_features()]).encode())
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
        try:
            subprocess.run([cc, *_FLAGS, march, "-o", built, source], check=True, capture_output=True, text=True,
                           timeout=120)
        except subprocess.CalledProcessError:  # a compiler without the -march flag: the histogram path only
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
        lib = load(_build(cc))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        warnings.warn(f"mindspeed-tp: compiling the exact gradient norm's host loop with {cc} failed ({detail.strip()[-300:]}); "
                      "it runs as torch operations instead (the same bits, ~10x slower on CPU)", RuntimeWarning, stacklevel=2)
        return None
    return lib


def load(path: str) -> ctypes.CDLL:
    """The built library with its functions' signatures."""
    lib = ctypes.CDLL(path)
    for name in ("exact_square_sums_f32", "exact_square_sums_f32_histogram"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4
    lib.exact_square_sums_windowed.restype = ctypes.c_int
    lib.exact_square_sums_windowed.argtypes = []
    return lib


def add_square_sums(lib: ctypes.CDLL, acc: torch.Tensor, chunk: torch.Tensor, nan_bin: int, inf_bin: int,
                    histogram_only: bool = False) -> None:
    """Adds the squares of ``chunk`` (fp32, host, at most ``MAX_ELEMENTS``) to ``acc`` (int64 (2, bins),
    host, contiguous) as ``grad_norm._add_chunk`` does; ``acc[0, nan_bin]`` / ``acc[0, inf_bin]`` become
    1 when a NaN / an inf is met. ``histogram_only``: every block by the histogram (tests compare the paths)."""
    assert chunk.dtype == torch.float32 and chunk.device.type == "cpu" and chunk.numel() <= MAX_ELEMENTS
    assert acc.dtype == torch.int64 and acc.device.type == "cpu" and acc.is_contiguous() and acc.dim() == 2
    assert acc.shape[1] >= MIN_BINS
    chunk = chunk.contiguous()
    base, row, word = acc.data_ptr(), acc.stride(0) * 8, 8
    run = lib.exact_square_sums_f32_histogram if histogram_only else lib.exact_square_sums_f32
    run(chunk.data_ptr(), chunk.numel(), base, base + row, base + nan_bin * word, base + inf_bin * word)
