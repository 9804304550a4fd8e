"""Worker (torchrun, 2 ranks, gloo): every collective the host staging wraps, staged.

The staging is installed for CPU tensors (``install_host_staging("cpu")``): each collective then
runs on host *copies* of its tensors, so a result reaches the caller's tensor only if the wrapper
copies it back -- what it must do for CUDA tensors on a shared GPU. Rank 0 prints one line per
case and rank, "OK name" or "BAD name detail"; the test asserts on them.
"""
import datetime

import torch
import torch.distributed as dist

from mindspeed_tp.check.host_staging import install_host_staging, remove_host_staging, staging_registry
from worker_exit import finish_worker

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
install_host_staging("cpu")
assert staging_registry().applied


results = []


def report(name, got, want):
    ok = torch.equal(got, want)
    results.append(("OK " if ok else "BAD ") + f"rank {rank} " + name +
                   ("" if ok else f" got {got.tolist()} want {want.tolist()}"))


def per_rank(r, n=4):
    return torch.arange(n, dtype=torch.float32) + 10 * r


for async_op in (False, True):
    t = per_rank(rank)
    handle = dist.all_reduce(t, async_op=async_op)
    if async_op:
        handle.wait()
    report(f"all_reduce async={async_op}", t, per_rank(0) + per_rank(1))

t = per_rank(rank)
dist.broadcast(t, src=1)
report("broadcast", t, per_rank(1))

outs = [torch.empty(4) for _ in range(world)]
dist.all_gather(outs, per_rank(rank))
report("all_gather", torch.stack(outs), torch.stack([per_rank(0), per_rank(1)]))

big = torch.full((3, 8), -1.0)
out = big[1]  # a view: the copy back must land in the caller's storage
dist.all_gather_into_tensor(out, per_rank(rank), async_op=True).wait()
report("all_gather_into_tensor (view, async)", big[1], torch.cat([per_rank(0), per_rank(1)]))
report("all_gather_into_tensor leaves the rest", big[0], torch.full((8,), -1.0))

out = torch.empty(2)
dist.reduce_scatter_tensor(out, per_rank(rank))
report("reduce_scatter_tensor", out, (per_rank(0) + per_rank(1))[2 * rank:2 * rank + 2])

# Uneven all-to-all: rank r sends r+1 rows to rank 0 and 2-r rows to rank 1... (3 rows each).
send = torch.arange(3, dtype=torch.float32) + 100 * rank
in_splits = [rank + 1, 2 - rank]
out_splits = [1 + r if rank == 0 else 2 - r for r in range(world)]
recv = torch.empty(sum(out_splits))
dist.all_to_all_single(recv, send, out_splits, in_splits)
pieces = []
for src in range(world):
    src_send = torch.arange(3, dtype=torch.float32) + 100 * src
    first = src + 1
    pieces.append(src_send[:first] if rank == 0 else src_send[first:])
report("all_to_all_single uneven", recv, torch.cat(pieces))

outs = [torch.empty(2) for _ in range(world)]
dist.all_to_all(outs, [per_rank(rank)[2 * d:2 * d + 2] for d in range(world)])
report("all_to_all", torch.stack(outs), torch.stack([per_rank(s)[2 * rank:2 * rank + 2] for s in range(world)]))

if rank == 0:
    dist.send(per_rank(7), dst=1)
    t = torch.empty(4)
    dist.recv(t, src=1)
    report("send/recv", t, per_rank(8))
else:
    t = torch.empty(4)
    dist.recv(t, src=0)
    dist.send(per_rank(8), dst=0)
    report("send/recv", t, per_rank(7))

peer = 1 - rank
t = torch.empty(4)
works = [dist.isend(per_rank(rank), peer), dist.irecv(t, peer)]
for w in works:
    w.wait()
report("isend/irecv", t, per_rank(peer))

t = torch.empty(4)
ops = [dist.P2POp(dist.isend, per_rank(rank + 2), peer), dist.P2POp(dist.irecv, t, peer)]
works = dist.batch_isend_irecv(ops)
for w in works:
    w.wait()
report("batch_isend_irecv", t, per_rank(peer + 2))

remove_host_staging()
assert not staging_registry().applied
t = per_rank(rank)
dist.all_reduce(t)
report("all_reduce after remove", t, per_rank(0) + per_rank(1))
everyone = [None] * world
dist.all_gather_object(everyone, results)
if rank == 0:
    print("\n".join(line for lines in everyone for line in lines), flush=True)
finish_worker()
