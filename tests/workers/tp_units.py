"""Worker (torchrun, world 4): megatron-core RowParallelLinear / ColumnParallelLinear and the
vocab-parallel logprob at TP 1, 2, 4 (SP on/off), vanilla and patched; rank 0 saves full outputs."""
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import mindspeed_tp
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.check.driver import init_distributed
from mindspeed_tp.kernels import vocab_parallel_logprob

out_path = sys.argv[1]
init_distributed()
install_cpu_shims()
from megatron.core import ModelParallelConfig, parallel_state  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from worker_exit import finish_worker

S, B, K, N, V = 24, 2, 96, 40, 1024
gen = torch.Generator().manual_seed(0)
X = torch.randn(S, B, K, generator=gen)
W_row = torch.randn(N, K, generator=gen) / K ** 0.5
W_col = torch.randn(N * 4, K, generator=gen) / K ** 0.5
LOGITS = 3 * torch.randn(S, B, V, generator=gen)
TARGET = torch.randint(0, V - 24, (S, B), generator=gen)
results = {}


def gather(t, dim, group):
    world = dist.get_world_size(group)
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    for mode in ("consistent", "vanilla"):
        if mode == "vanilla":
            mindspeed_tp.disable()
        else:
            mindspeed_tp.enable()
        for tp in (1, 2, 4):
            for sp in ((False, True) if tp > 1 else (False,)):
                if parallel_state.model_parallel_is_initialized():
                    parallel_state.destroy_model_parallel()
                parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
                group = parallel_state.get_tensor_model_parallel_group()
                r = parallel_state.get_tensor_model_parallel_rank()
                cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, params_dtype=dtype,
                                          use_cpu_initialization=True, perform_initialization=False)
                name = f"{mode}/{dtype_name}/tp{tp}{'-sp' if sp else ''}"
                row = RowParallelLinear(K, N, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                                        input_is_parallel=True, skip_bias_add=False)
                col = ColumnParallelLinear(K, N * 4, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                                           gather_output=False)
                with torch.no_grad():
                    row.weight.copy_(W_row.chunk(tp, dim=1)[r].to(dtype))
                    col.weight.copy_(W_col.chunk(tp, dim=0)[r].to(dtype))
                    x = X.to(dtype)
                    y, _ = row(x.chunk(tp, dim=2)[r].contiguous())
                    results[f"{name}/row"] = gather(y, 0, group) if sp else y
                    xin = x.chunk(tp, dim=0)[r].contiguous() if sp else x
                    z, _ = col(xin)
                    results[f"{name}/column"] = gather(z, 2, group)
                    if mode == "consistent":
                        lp = vocab_parallel_logprob(LOGITS.to(dtype).chunk(tp, dim=2)[r], TARGET, group, 8,
                                                    vocab_size=V - 24)
                        results[f"{name}/logprob"] = lp
if dist.get_rank() == 0:
    save_file({k: v.float().contiguous() for k, v in results.items()}, out_path)
finish_worker()
