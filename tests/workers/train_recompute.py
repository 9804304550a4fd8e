"""Worker (torchrun, 2 processes): train-check's training run (megatron DDP, optimizer, schedule,
finalize_model_grads; no distributed optimizer, no overlap) at tp2-sp with activation recomputation
none, selective and full; saves each run's losses, in-step logprobs, gradient norms and final
parameters (this rank's shards) per rank."""
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.check.driver import init_distributed
from mindspeed_tp.check.settings import TrainSettings
from mindspeed_tp.check.train.loop import train_layout
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.spec import load_model_spec
from mindspeed_tp.contract.profile import load_profile
from worker_exit import finish_worker

init_distributed()
install_cpu_shims()
spec, profile = load_model_spec(sys.argv[2]), load_profile()
out = {}
for recompute in ("none", "selective", "full"):
    settings = TrainSettings(steps=2, global_batch_size=4, seq_length=32, recompute=recompute)
    run = train_layout(spec, Layout.parse(sys.argv[3]), torch.float32, profile, settings, vanilla=False)
    for field in ("loss", "logprobs", "grad_norm"):
        out[f"{recompute}/{field}"] = run[field]
    for name, t in run["params"][-1].items():
        out[f"{recompute}/param/{name}"] = t
save_file({k: v.contiguous() for k, v in out.items()}, f"{sys.argv[1]}.rank{dist.get_rank()}.safetensors")
finish_worker()
