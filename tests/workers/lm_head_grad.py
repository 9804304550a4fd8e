"""Worker (torchrun, 4 ranks, gloo): the LM head's input gradient under bitwise training at TP 1, 2, 4,
with and without SP, for a real vocabulary (151936: Megatron pads it to 151936 / 152064 / 152064 at
TP 1 / 2 / 4, so the held rows and the canonical shards differ and rows move) and a small one whose
last ranks hold only padding rows of some shards.

Every rank computes the TP=1 result itself, then takes part in the TP=2 groups {0,1}, {2,3} and the
TP=4 group. The padded rows of dy and W are NaN: any use of them shows. Rank 0 prints "OK case" or
"BAD case detail" per case and rank; the test asserts on those lines.
"""
import datetime
import math
import sys

import torch
import torch.distributed as dist

from mindspeed_tp.check.metrics import same_bits
from mindspeed_tp.numerics.bitwise_training.lm_head_grad import lm_head_input_grad
from worker_exit import finish_worker

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
groups = {1: None, 2: [dist.new_group([0, 1]), dist.new_group([2, 3])], 4: dist.new_group([0, 1, 2, 3])}
SHARDS, M, H = 8, 32, 48
lines = []


def padded(vocab: int, tp: int) -> int:
    multiple = 128 * tp  # megatron's make_vocab_size_divisible_by x TP
    return math.ceil(vocab / multiple) * multiple


def case(vocab: int, width: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(vocab + width)
    dy = torch.randn(M, vocab, generator=gen).to(dtype)
    w = torch.randn(vocab, H, generator=gen).to(dtype)
    one = lm_head_input_grad(dy, w, None, vocab, SHARDS, width, dtype, False, 16)
    name = f"vocab={vocab} width={width} {str(dtype).split('.')[-1]}"
    # The tree computes dy @ W: a semantics check (tolerance), the bitwise claims follow.
    plain = (dy.double() @ w.double()).to(dtype)
    close = torch.allclose(one.double(), plain.double(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-2)
    lines.append(("OK " if close else "BAD ") + f"{name} tp1 computes dy @ W")
    for tp in (2, 4):
        group = groups[tp][rank // 2] if tp == 2 else groups[tp]
        r = rank % tp
        v_pad = padded(vocab, tp)
        v_local = v_pad // tp
        full_dy = torch.cat([dy, torch.full((M, v_pad - vocab), float("nan"), dtype=dtype)], dim=1)
        full_w = torch.cat([w, torch.full((v_pad - vocab, H), float("nan"), dtype=dtype)])
        mine_dy = full_dy[:, r * v_local:(r + 1) * v_local].contiguous()
        mine_w = full_w[r * v_local:(r + 1) * v_local].contiguous()
        for sp in (False, True):
            got = lm_head_input_grad(mine_dy, mine_w, group, vocab, SHARDS, width, dtype, sp, 16)
            want = one[r * M // tp:(r + 1) * M // tp] if sp else one
            ok = same_bits(got, want)
            lines.append(("OK " if ok else "BAD ") + f"{name} tp{tp}{'-sp' if sp else ''} rank {rank}"
                         + ("" if ok else f" max diff {(got.double() - want.double()).abs().max().item():.3e}"))


case(151936, 2048, torch.float32)
case(151936, 2048, torch.bfloat16)
case(151936, 16, torch.float32)  # the old leaf count (9496 leaves): rows move across leaf boundaries
case(1000, 64, torch.float32)    # TP=4: rank 3 holds 232 true rows of 256; shards of 125 rows

gathered = [None] * world
dist.all_gather_object(gathered, lines)
if rank == 0:
    for rank_lines in gathered:
        for line in rank_lines:
            print(line)
    sys.stdout.flush()
finish_worker()
