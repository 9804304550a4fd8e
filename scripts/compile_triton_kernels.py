"""One compiled variant per numerics, checked on a CPU: the triton backend's kernels compiled ahead of
time for a CUDA architecture with the arguments its call sites really pass -- no GPU needed.

    python scripts/compile_triton_kernels.py [--arch 90 80] [--tests] [--only WORD...]

Each call site (training with and without megatron's causal mask, key padding, chunked prefill,
paged decode, packed sequences, CP's local queries, GQA at every TP's heads per rank; the GEMMs of
linear layers, row-parallel leaves and the router; the row kernels) runs the real wrapper of
``kernels/backends/triton.py`` on CPU tensors with every kernel replaced by a recorder. Triton's own
binder turns each recorded launch into the specialisation it would compile (argument types, values
specialised to constants, divisibility of pointers and integers). Launches with the same numerics
(kernel, constexprs, pointer types, launch options) must have one specialisation; if not, the
report says which arguments differ and whether the first two variants' TTGIR does. Every numerics goes
through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the wheel's ptxas) and the
cubin's resource usage (``cuobjdump -res-usage``) must show no stack: a spill is local memory there,
not in the PTX. Every product of a bf16 GEMM and of attention's forward and backward must be a
tensor-core MMA (the TTGIR's dots in an MMA encoding; HGMMA / HMMA counted in ``cuobjdump -sass``).
Besides the small call sites, users' dimensions run on meta tensors (no memory): Qwen3-8B / 30B-A3B
at 32k tokens and the LM head at 64k x 151936 (integers past 2**31). ``--table FILE`` writes the
compiled-code table (registers, shared memory, stack, MMA instructions) docs/DEVICES.md carries.
What this does not show: that the kernels run, how fast, or what their bits are (a GPU run:
scripts/device_check.sh).

Models: the supported head dims (32, 64, 96, 128), bf16 and fp32, the profiles' 128-key blocks;
``--tests`` adds tests/test_triton_backend.py's small configurations (16/12-key blocks, a split);
tests/test_triton_compiled.py runs it with both. The attention tiles depend on the GPU generation (``triton_kernels.ATTN_TILES``): each arch is recorded as that GPU's launches. Exit 1
when a numerics has two variants or a kernel spills. Uses Triton's launch binder
(``create_function_from_signature``, ``JITFunction._pack_args``; Triton 3.6 and 3.9: put another
Triton first on PYTHONPATH to compile with it).
"""
import argparse
import collections
import contextlib
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

Launch = collections.namedtuple("Launch", "site kernel args kwargs")
HEAD_DIMS = (32, 64, 96, 128)  # the bundled models' kv_channels and the users' (Qwen, Llama, Mistral, ...)
BLOCK = 128  # the profiles' attention_block_size
KERNELS = ("gemm_kernel", "row_sum_kernel", "softmax_kernel", "attention_kernel", "attention_delta_kernel",
           "attention_dkdv_kernel", "attention_dq_kernel")
# Kernels whose every product must run on tensor cores in bf16 / fp16 (the matmul main loops).
TENSOR_CORE_KERNELS = ("gemm_kernel", "attention_kernel", "attention_dkdv_kernel", "attention_dq_kernel")
MMA = {90: "HGMMA", 80: "HMMA"}  # the SASS tensor-core instruction of each architecture


def load_backend():
    """The triton backend and its kernels module with compiled (not interpreted) kernels."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter does not compile")
    kernels = importlib.import_module("mindspeed_tp.kernels.backends.triton_kernels")
    if kernels.INTERPRETED:
        kernels = importlib.reload(kernels)
    return importlib.import_module("mindspeed_tp.kernels.backends.triton"), kernels


class _Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, fn, log, site):
        self.fn, self.log, self.site = fn, log, site

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(Launch(self.site[0], self.fn, args, kwargs))


@contextlib.contextmanager
def recording(backend, kernels, log, site, arch):
    """The wrappers on CPU tensors as on a CUDA GPU of sm_<arch> (no device check), every kernel
    launch recorded under the current ``site[0]``."""
    from mindspeed_tp.kernels import dispatch

    names = KERNELS
    saved = {n: getattr(kernels, n) for n in names}
    check, generation, chosen = backend._check_device, backend._generation, dispatch.selected()
    for n in names:
        setattr(kernels, n, _Recorder(saved[n], log, site))
    backend._check_device = lambda *tensors: None
    backend._generation = lambda device: 9 if arch >= 90 else 8
    dispatch.select("triton")
    try:
        yield
    finally:
        for n in names:
            setattr(kernels, n, saved[n])
        backend._check_device, backend._generation = check, generation
        dispatch.select(chosen)


def _call_sites(backend, tests):
    """(site, thunk) for every way the package calls a kernel; the thunks run the real wrappers."""
    import torch
    from mindspeed_tp.kernels.linear import leaf_partials

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape).to(dtype)

    sites = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        # Linear layers: M from a decode step's 1 row to a batch, N of a column shard, K the hidden
        # size or an odd one; the LM head in fp32; biases; weight shards as views or copies.
        for m, n, k in ((1, 96, 64), (37, 80, 96), (300, 256, 24), (5, 33, 1000)):
            x, w = t(m, k, dtype=dtype), t(n, k, dtype=dtype)
            sites.append((f"linear {name}", lambda x=x, w=w, d=dtype: backend.linear(x, w, d)))
            sites.append((f"linear {name} bias", lambda x=x, w=w, d=dtype: backend.linear(x, w, d, bias=w[:, 0])))
            sites.append((f"linear {name} fp32 out", lambda x=x, w=w: backend.linear(x, w, torch.float32)))
            sites.append((f"linear {name} shard view", lambda x=x, w=w, d=dtype, n=n: backend.linear(x, w[n // 2:], d)))
        # Row-parallel leaves: C leaves of K/C columns, strided views of x and the weight.
        for leaves, width in ((8, 24), (4, 64), (2, 16)):
            x, w = t(19, leaves * width, dtype=dtype), t(48, leaves * width, dtype=dtype)
            sites.append((f"leaves {name}", lambda x=x, w=w, c=leaves: leaf_partials(x, w, c)))
        sites.append((f"matmul {name} row-major b", lambda d=dtype: backend.matmul(t(7, 40, dtype=d), t(40, 24,
                                                                                                      dtype=d))))
        # Row kernels: logprob leaves (rows of V/C), norms' sums, rows that start unaligned.
        for rows, width in ((12, 1000), (3, 4096), (70, 625), (5, 7)):
            x = t(rows, width + 1, dtype=dtype)
            sites.append((f"row_sum {name}", lambda x=x, w=width: backend.row_sum(x[:, :w])))
            sites.append((f"row_sum {name} offset", lambda x=x, w=width: backend.row_sum(x[:, 1:w + 1])))
        sites.append((f"softmax {name} router", lambda d=dtype: backend.softmax(t(10, 8, dtype=d))))
        sites.append((f"softmax {name} router", lambda d=dtype: backend.softmax(t(33, 128, dtype=d)[:, 3:67])))
    sites.append(("linear router mixed", lambda: backend.linear(t(9, 64, dtype=torch.bfloat16), t(8, 64),
                                                                 torch.float32)))

    configs = [(dtype, name, d, BLOCK, None) for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))
               for d in HEAD_DIMS]
    if tests:
        configs += [(torch.float32, "fp32", 32, 16, None), (torch.float32, "fp32", 32, 16, 32),
                    (torch.bfloat16, "bf16", 32, 12, None)]
    for dtype, name, d, block, split in configs:
        sites += _attention_sites(t, dtype, name, d, block, split)
    return sites


def _attention_sites(t, dtype, name, d, block, split):
    """The attention call sites at one numerics (dtype, head dim, key block, split)."""
    import torch
    from mindspeed_tp.kernels import attention as attn
    from mindspeed_tp.kernels import context_parallel as cp

    sites = []
    tag = f"{name} d={d} block={block}" + (f" split={split}" if split else "")
    kw = dict(block_size=block, split_size=split)
    for hq, hkv in ((8, 4), (2, 1), (1, 1), (4, 4)):  # GQA at TP 1/4/8 heads per rank, and MHA
        b, s = 3, 70
        q, k, v = t(b, hq, s, d, dtype=dtype), t(b, hkv, s, d, dtype=dtype), t(b, hkv, s, d, dtype=dtype)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
        pad = torch.arange(s).view(1, 1, 1, s) >= torch.tensor([70, 51, 17]).view(b, 1, 1, 1)
        sites += [
            (f"attention {tag} training, megatron's causal mask",
             lambda q=q, k=k, v=v, m=causal: attn.consistent_attention(q, k, v, 0.1, True, excluded=m, **kw)),
            (f"attention {tag} training, mask and no causal flag",
             lambda q=q, k=k, v=v, m=causal: attn.consistent_attention(q, k, v, 0.1, False, excluded=m, **kw)),
            (f"attention {tag} training, causal flag",
             lambda q=q, k=k, v=v: attn.consistent_attention(q, k, v, 0.1, True, **kw)),
            (f"attention {tag} key padding", lambda q=q, k=k, v=v, m=pad: attn.consistent_attention(
                q[:, :, :10], k, v, 0.1, False, excluded=m, **kw)),
            (f"attention {tag} key padding, causal", lambda q=q, k=k, v=v, m=pad | causal: attn.consistent_attention(
                q, k, v, 0.1, True, excluded=m, **kw)),
            (f"attention {tag} chunked prefill", lambda q=q, k=k, v=v: attn.consistent_attention(
                q[:, :, 7:23], k[:, :, :23], v[:, :, :23], 0.1, True, q_positions=torch.arange(7, 23), **kw)),
            (f"attention {tag} CP local queries", lambda q=q, k=k, v=v, m=causal: cp.cp_attention(
                q[:, :, 10:20], k, v, 0.1, True, torch.arange(10, 20), m[:, :, 10:20], block, 16, split)),
            (f"attention {tag} packed", lambda q=q, k=k, v=v: attn.packed_attention(
                q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous(),
                v[0].transpose(0, 1).contiguous(), [0, 13, 40, 70], 0.1, True, **kw)),
        ]
        sites.append((f"attention {tag} backward, megatron's causal mask", lambda q=q, k=k, v=v, m=causal: _backward(
            lambda *qkv: attn.consistent_attention(*qkv, 0.1, True, excluded=m, **kw), q, k, v)))
        sites.append((f"attention {tag} backward, CP local queries", lambda q=q, k=k, v=v: _backward(
            lambda *qkv: attn.consistent_attention(*qkv, 0.1, True, q_positions=torch.arange(10, 20), **kw),
            q[:, :, 10:20], k, v)))
        sites.append((f"attention {tag} backward, key padding", lambda q=q, k=k, v=v, m=pad: _backward(
            lambda *qkv: attn.consistent_attention(*qkv, 0.1, False, excluded=m, **kw), q, k, v)))
        for page, sq in ((16, 1), (5, 3), (BLOCK, 1)):  # paged decode: the engine's step, a few tokens
            pages = 2 * -(-s // page) + 1
            kc, vc = t(pages, page, hkv, d, dtype=dtype), t(pages, page, hkv, d, dtype=dtype)
            table = torch.randperm(pages)[: 2 * -(-s // page)].view(2, -1).to(torch.int32)
            lens = torch.tensor([s, s - 9], dtype=torch.int32)
            sites.append((f"attention {tag} paged decode", lambda q=q, kc=kc, vc=vc, tb=table, ln=lens, n=sq:
                          attn.decode_attention(q[:2, :, :n], kc, vc, ln, tb, 0.1, **kw)))
    return sites


def _backward(fn, q, k, v):
    """fn(q, k, v) and its backward: the backward kernels' launches."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(out.new_ones(out.shape))


def _real_shape_sites(backend):
    """Launches at users' dimensions, on meta tensors (no memory): Qwen3-8B (hidden 4096, 32 / 8 heads
    of 128, FFN 12288) and Qwen3-30B-A3B (hidden 2048, 32 / 4 heads, experts of 768) at 32k tokens, the
    LM head over vocab 151936 at 64k tokens in fp32 (its output's batch stride is past 2**31 in
    16-byte units: an integer Triton would type i64 by value). Each must be the numerics' one binary."""
    import torch
    from mindspeed_tp.kernels import attention as attn

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    tokens = 32768
    sites = [
        ("real linear bf16 qkv 8B", lambda: backend.linear(meta(tokens, 4096), meta(6144, 4096), torch.bfloat16)),
        ("real linear bf16 fc1 8B", lambda: backend.linear(meta(tokens, 4096), meta(24576, 4096), torch.bfloat16)),
        ("real linear bf16 expert 30B-A3B", lambda: backend.linear(meta(4096, 2048), meta(1536, 2048),
                                                                   torch.bfloat16)),
        ("real lm head fp32 64k x 151936", lambda: backend.linear(meta(65536, 4096, dtype=torch.float32),
                                                                  meta(151936, 4096, dtype=torch.float32),
                                                                  torch.float32)),
        ("real lm head bf16 -> fp32 64k x 151936", lambda: backend.linear(meta(65536, 4096), meta(151936, 4096),
                                                                          torch.float32)),
    ]
    for hq, hkv, label in ((32, 8, "8B"), (32, 4, "30B-A3B")):
        q, k = meta(1, hq, tokens, 128), meta(1, hkv, tokens, 128)
        sites.append((f"real attention bf16 d=128 block={BLOCK} {label} 32k",
                      lambda q=q, k=k: attn.consistent_attention(q, k, k, 0.1, True, block_size=BLOCK)))
        sites.append((f"real attention bf16 d=128 block={BLOCK} {label} 32k backward", lambda q=q, k=k: _backward(
            lambda *qkv: attn.consistent_attention(*qkv, 0.1, True, block_size=BLOCK), q, k, k)))
    return sites


def record(backend, kernels, arch, tests=False):
    """Every launch the call sites make on an sm_<arch> GPU, each with its site's name."""
    log, site = [], [None]
    with recording(backend, kernels, log, site, arch):
        for name, thunk in _call_sites(backend, tests) + _real_shape_sites(backend):
            site[0] = name
            thunk()
    return log


def specialise(launch, backend):
    """What Triton compiles for this launch: (options, signature, constexprs, attrs), by its own binder."""
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    return fn._pack_args(backend, launch.kwargs, bound, specialization, options)


def _numerics(launch, signature, options):
    """What may change the computation: the kernel, its declared constexprs, the pointers' element
    types, the launch options. Everything else must not (one variant per numerics)."""
    declared = {p.name for p in launch.kernel.params if p.is_constexpr}
    consts = tuple(sorted((k, v) for k, v in launch.kwargs.items() if k in declared))
    pointers = tuple(sorted((k, v) for k, v in signature.items() if v.startswith("*")))
    opts = (options.num_warps, options.num_stages, options.enable_fp_fusion)
    return launch.kernel.__name__, consts, pointers, opts


def _variant(signature, constexprs, attrs):
    return repr((sorted(signature.items()), sorted(constexprs.items()), sorted(attrs.items())))


def _differences(fn, a, b):
    """The arguments whose specialisation differs between two variants' (signature, constexprs, attrs)."""
    names = [p.name for p in fn.params]
    out = []
    for da, db in zip(a, b):
        for key in sorted(set(da) | set(db), key=str):
            if da.get(key) != db.get(key):
                name = key if isinstance(key, str) else names[key[0]]
                out.append(f"{name}: {da.get(key)} / {db.get(key)}")
    return out


def _strip_locations(ir):
    return "\n".join(re.sub(r"\s*loc\(.*?\)\s*$", "", line) for line in ir.splitlines() if not line.startswith("#loc"))


def _tool(name):
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_variant(fn, options, signature, constexprs, attrs, target):
    """The full pipeline for one variant: a dict with the TTGIR without source locations, the cubin's
    resource usage ({REG, STACK, SHARED, ...}), the tensor-core MMA instructions in its SASS, the dots
    in the TTGIR and how many of them are tensor-core MMAs, and the seconds it took."""
    import triton
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    out = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=target,
                         options=options.__dict__)
    seconds = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(out.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", usage.split("Resource usage:")[-1]))
    ttgir = _strip_locations(out.asm["ttgir"])
    dots, mma_dots = _dots(ttgir)
    mma = MMA.get(target.arch, "MMA")
    usage = {k: int(v) for k, v in found.items()}
    usage["SHARED"] = out.metadata.shared  # dynamic shared memory (the operand tiles); -res-usage shows static
    return dict(ttgir=ttgir, usage=usage, seconds=seconds, dots=dots,
                mma_dots=mma_dots, mma=len(re.findall(rf"\b{mma}\.", sass)))


def _dots(ttgir):
    """(dot operations, those on tensor cores) in a TTGIR: ``ttng.warp_group_dot`` (sm_90's wgmma) or a
    ``tt.dot`` whose result has an MMA encoding (sm_80's mma); a ``tt.dot`` into a blocked layout is FMA."""
    total = mma = 0
    for line in ttgir.splitlines():
        if "ttng.warp_group_dot " in line and "warp_group_dot_wait" not in line:
            total += 1
            mma += 1
        elif re.search(r"= tt\.dot ", line):
            total += 1
            result = line.rsplit("->", 1)[-1]
            mma += bool(re.search(r"#mma|nvidia_mma", result))
    return total, mma


def _label(name, consts, pointers):
    return f"{name} " + " ".join(f"{k}={v}" for k, v in consts if k != "INTERPRETED") + \
        " " + ",".join(f"{k}:{v}" for k, v in pointers)


def check(arch, tests=False, out=print, only=None, table=None):
    """Compile every numerics' variants for sm_<arch>; returns the list of failures (empty: passed).
    ``table``: a list the rows of the compiled-code table are appended to."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend_mod, kernels = load_backend()
    launches = record(backend_mod, kernels, arch, tests)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    groups = collections.OrderedDict()
    for launch in launches:
        options, signature, constexprs, attrs = specialise(launch, backend)
        key = _numerics(launch, signature, options)
        variants = groups.setdefault(key, collections.OrderedDict())
        entry = variants.setdefault(_variant(signature, constexprs, attrs),
                                    dict(spec=(options, signature, constexprs, attrs), sites=[], fn=launch.kernel))
        if launch.site not in entry["sites"]:
            entry["sites"].append(launch.site)
    failures = []
    out(f"triton {triton.__version__}, sm_{arch}, FP fusion {kernels.FP_FUSION}: {len(launches)} "
        f"launches, {len(groups)} numerics")
    for (name, consts, pointers, opts), variants in groups.items():
        label = _label(name, consts, pointers)
        if only and not all(word in label for word in only):
            continue
        entries = list(variants.values())
        irs = []
        for entry in entries[:2]:  # a second variant fails already: compile two to compare their TTGIR
            options, signature, constexprs, attrs = entry["spec"]
            result = compile_variant(entry["fn"], options, signature, constexprs, attrs, target)
            usage = result["usage"]
            irs.append(result["ttgir"])
            out(f"  {label}: REG {usage.get('REG')} STACK {usage.get('STACK')} SHARED {usage.get('SHARED')} "
                f"{MMA[arch]} {result['mma']} dots {result['mma_dots']}/{result['dots']} on tensor cores "
                f"({result['seconds']:.1f}s; {len(entry['sites'])} sites)")
            if usage.get("STACK", 0):
                failures.append(f"sm_{arch} {label}: {usage['STACK']} bytes of stack (register spills), "
                                f"{usage.get('REG')} registers")
            if name in TENSOR_CORE_KERNELS and _dtype_of(signature) in ("bf16", "fp16"):
                if result["mma_dots"] != result["dots"] or not result["mma"]:
                    failures.append(f"sm_{arch} {label}: {result['dots'] - result['mma_dots']} of {result['dots']} "
                                    f"products off the tensor cores ({result['mma']} {MMA[arch]} in the SASS)")
            if table is not None and entry is entries[0]:
                table.append(dict(kernel=name, numerics=" ".join(f"{k}={v}" for k, v in consts
                                                                 if k not in ("INTERPRETED", "BLOCK_D")),
                                  dtype=_dtype_of(signature), arch=f"sm_{arch}", triton=triton.__version__,
                                  reg=usage.get("REG"), shared=usage.get("SHARED"), stack=usage.get("STACK"),
                                  mma=result["mma"], dots=f"{result['mma_dots']}/{result['dots']}",
                                  sites=len(entry["sites"])))
        if len(entries) > 1:
            diffs = sorted({d for other in entries[1:]
                            for d in _differences(entries[0]["fn"], entries[0]["spec"][1:], other["spec"][1:])})
            failures.append(f"sm_{arch} {label}: {len(entries)} compiled variants for one numerics (the first two's "
                            f"TTGIR {'differs' if irs[1] != irs[0] else 'is identical'}); specialisations differing "
                            f"from the first: {diffs}; sites {entries[0]['sites'][:2]} vs {entries[1]['sites'][:2]}")
    return failures


def _dtype_of(signature):
    first = next((v for v in signature.values() if v.startswith("*")), "*?")
    return first[1:]


def markdown_table(rows):
    """The compiled-code table (docs/DEVICES.md carries it)."""
    head = "| kernel | inputs | numerics | arch | Triton | registers | shared memory (B) | stack | MMA instructions | " \
           "dots on tensor cores | call sites |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        mma = f"{r['mma']} {MMA[int(r['arch'][3:])]}" if r["mma"] else "0"
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r['numerics']} | {r['arch']} | {r['triton']} | {r['reg']} | "
                     f"{r['shared']} | {r['stack']} | {mma} | {r['dots']} | {r['sites']} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80],
                   help="CUDA compute capabilities as integers (90: H100/H200, 80: A100)")
    p.add_argument("--tests", action="store_true", help="also tests/test_triton_backend.py's small configurations")
    p.add_argument("--only", nargs="+", help="only the numerics whose label holds all these words")
    p.add_argument("--table", help="write the compiled-code table (markdown) to this file")
    args = p.parse_args(argv)
    failures, rows = [], []
    for arch in args.arch:
        failures += check(arch, args.tests, only=args.only, table=rows)
    if args.table:
        with open(args.table, "w") as f:
            f.write(markdown_table(rows) + "\n")
    for f in failures:
        print("FAIL", f)
    print("one variant per numerics, no spills" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
