"""The checker's context-parallel batch: what each CP rank feeds the model (Megatron's
``get_batch_on_this_cp_rank`` / ``get_thd_batch_on_this_cp_rank`` layout, ``kernels/context_parallel``)
and how the ranks' per-token results are put back in sequence order."""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels import context_parallel as cp
from ..kernels.collectives import gather_along_rank


def cp_state():
    """(group, size, rank) of Megatron's context-parallel group; (None, 1, 0) at CP = 1."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group(check_initialized=False)
    if group is None or group.size() == 1:
        return None, 1, 0
    return group, group.size(), group.rank()


def local_columns(length: int, size: int, rank: int, cu_seqlens=None) -> torch.Tensor:
    """The columns of the (b, length) padded batch, or of the packed row with ``cu_seqlens``, that CP
    rank ``rank`` holds, in its local order."""
    if size == 1:
        return torch.arange(length)
    if cu_seqlens is not None:
        return cp.packed_local_index(cu_seqlens, size, rank)
    return cp.local_positions(length, size, rank)


def gather_columns(local: torch.Tensor, length: int, group, size: int, cu_seqlens=None) -> torch.Tensor:
    """(rows, n_local) per-token values of every CP rank -> (rows, length) in sequence order (data
    moved, nothing added: an exact -0.0 stays -0.0)."""
    if size == 1:
        return local
    parts = gather_along_rank(local.contiguous(), group)  # (size, rows, n_local)
    full = local.new_zeros(local.shape[0], length)
    for r in range(size):
        full[:, local_columns(length, size, r, cu_seqlens)] = parts[r]
    return full


def global_rows(columns: torch.Tensor, batch: int) -> torch.Tensor:
    """Megatron's [s, b] token order: local token (s_l, i) at s_l*b+i -> its row columns[s_l]*b+i
    in the whole sequence."""
    return (columns.unsqueeze(1) * batch + torch.arange(batch).unsqueeze(0)).reshape(-1)


def place_rows(chosen: torch.Tensor, rows: Optional[torch.Tensor], total: int) -> torch.Tensor:
    """(n_local, E) rows of this rank -> (total, E), zeros where another CP rank holds the token."""
    if rows is None:
        return chosen
    full = chosen.new_zeros(total, chosen.shape[1])
    full[rows.to(chosen.device)] = chosen
    return full

