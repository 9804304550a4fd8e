"""Work cut into pieces the caller fixes, each piece computed by a thread that has one intra-op thread.

CPU libraries choose their code, and with it the order of a sum, from the call's shape *and* the
threads it may use: oneDNN and MKL switch GEMM kernels (AVX2, AVX-512, AMX micro-kernels, K blocking)
with M and split K across threads when M x N is small; ATen cuts an elementwise range at
thread-count-dependent offsets, and each cut leaves a tail for the op's scalar code. So an invariant
kernel never lets a library split its work: it cuts the work itself at boundaries that depend only on
the problem (GEMM tiles of fixed shape, runs of whole vector steps) and hands each piece to a worker
thread whose intra-op thread count is one. Each piece is then one single-threaded library call of a
fixed shape, whatever the thread count, and the pieces run in parallel across the caller's intra-op
threads (``torch.get_num_threads()``), so a many-core host still uses its cores.

``torch.set_num_threads`` is per thread in torch's OpenMP build (the OpenMP thread-count variable and
MKL's local count are thread-local): a worker sets it once and the caller's count is untouched. A
torch whose thread count is one process-wide value (its native thread pool) is refused by name
(``intra_op_threads``) rather than run with split calls.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, TypeVar

import torch

from ..contract.refusals import refuse

T = TypeVar("T")

_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0
_local = threading.local()  # is_worker: this thread is one of the pool's


def _become_worker() -> None:
    _local.is_worker = True
    try:
        torch.set_num_threads(1)
    except RuntimeError:  # a native thread pool already started: the count check below refuses it
        pass


def _drop_pool_in_child() -> None:
    # A forked child has none of the parent's worker threads: it starts its own pool when it needs one.
    global _pool, _pool_size
    _pool, _pool_size = None, 0


os.register_at_fork(after_in_child=_drop_pool_in_child)


def _workers(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != size:
            old = _pool
            caller = torch.get_num_threads()
            pool = ThreadPoolExecutor(size, "mindspeed-tp-piece", initializer=_become_worker)
            started = threading.Barrier(size, timeout=120)  # every worker thread started now, not later
            counts = list(pool.map(lambda _: (started.wait(), torch.get_num_threads())[1], range(size)))
            if torch.get_num_threads() != caller or any(n != 1 for n in counts):
                pool.shutdown(wait=False)
                raise refuse("intra_op_threads", threads=caller)
            # A worker's set_num_threads(1) also set the count threads started later begin with: the caller's again.
            torch.set_num_threads(caller)
            _pool, _pool_size = pool, size
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def threads() -> int:
    """How many pieces run at once for the calling thread (1 inside a worker)."""
    return 1 if getattr(_local, "is_worker", False) else max(1, torch.get_num_threads())


def run_pieces(compute: Callable[[T], None], pieces: Sequence[T]) -> None:
    """``compute(piece)`` for every piece (each writes its own part of a preallocated output), each in a
    thread with one intra-op thread: inline when the caller has one thread (or is a worker itself),
    else the pieces dealt round-robin to ``threads()`` workers."""
    if torch.get_num_threads() == 1:  # the caller (or a worker) computes every piece in its one thread
        _each(compute, pieces)
        return
    pool = _workers(threads())
    size = min(threads(), len(pieces))
    futures = [pool.submit(_each, compute, pieces[i::size]) for i in range(size)]
    for f in futures:
        f.result()


def _each(compute: Callable[[T], None], pieces: Sequence[T]) -> None:
    if torch.get_num_threads() != 1:  # a worker whose set_num_threads(1) did not take
        raise refuse("intra_op_threads", threads=torch.get_num_threads())
    with torch.no_grad():  # pieces write into outputs made beforehand: nothing here is differentiated
        for piece in pieces:
            compute(piece)


def map_pieces(compute: Callable[[T], torch.Tensor], pieces: Sequence[T]) -> List[torch.Tensor]:
    """``[compute(piece) for piece in pieces]`` computed as ``run_pieces`` does."""
    results: List[Optional[torch.Tensor]] = [None] * len(pieces)

    def one(item):
        i, piece = item
        results[i] = compute(piece)

    run_pieces(one, list(enumerate(pieces)))
    return results  # type: ignore[return-value]
