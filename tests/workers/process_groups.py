"""Two ranks at TP 2: a pg_collection of parallel_state's groups is accepted, one whose TP group is
another set of ranks is refused naming it (contract/model_arguments.check_process_groups). Rank 0
prints both ranks' outcomes (gathered as integers: no interleaved output)."""
from types import SimpleNamespace

import torch
import torch.distributed as dist

import mindspeed_tp
from mindspeed_tp.check.driver import init_distributed
from mindspeed_tp.contract.model_arguments import check_process_groups
from worker_exit import finish_worker

init_distributed()
from megatron.core import parallel_state  # noqa: E402

parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
rank = dist.get_rank()
other = [dist.new_group([r]) for r in range(2)]  # every rank creates both, in the same order
check_process_groups(SimpleNamespace(tp=parallel_state.get_tensor_model_parallel_group(),
                                     cp=parallel_state.get_context_parallel_group()))
outcome = torch.zeros(2, 2, dtype=torch.int64)
outcome[rank, 0] = 1  # accepted
message = ""
try:
    check_process_groups(SimpleNamespace(tp=other[rank]))
except mindspeed_tp.ConfigError as exc:
    message = str(exc)
    outcome[rank, 1] = int(f"GPTModel(pg_collection.tp=[{rank}])" in message)
dist.all_reduce(outcome)
if rank == 0:
    print("ACCEPTED", outcome[:, 0].tolist(), "REFUSED BY NAME", outcome[:, 1].tolist(), "|", message)
finish_worker()
