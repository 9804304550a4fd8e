"""Worker (torchrun, TP=2): verl's Megatron actor logprob (the stand-in verl package, imported
with VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl) on each rank's vocab shard, next to the TP=1
logprob of the full logits, and verl's own path after mindspeed_tp.disable()."""
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import verl  # noqa: F401  (imports mindspeed_tp.verl from the environment variable)
import mindspeed_tp
from mindspeed_tp.check.harness import _setup_parallel_state, init_distributed
from mindspeed_tp.kernels import vocab_parallel_logprob
from mindspeed_tp.check.models.layout import Layout
from verl.workers.actor import megatron_actor

init_distributed()
_setup_parallel_state(Layout.parse("tp2"), seed=0)
rank = dist.get_rank()
gen = torch.Generator().manual_seed(0)
full = torch.randn(3, 10, 1024, generator=gen) * 4
labels = torch.randint(0, 1024, (3, 10), generator=gen)
mask = torch.rand(3, 10, generator=gen) > 0.2
shard = full[..., rank * 512 : (rank + 1) * 512]

ours = megatron_actor.logits_processor(shard.clone(), labels, mask, temperature=0.7)
tp1 = vocab_parallel_logprob(full / 0.7, labels, None, mindspeed_tp.load_profile().canonical_shards)
mindspeed_tp.disable()
verl_own = megatron_actor.logits_processor(shard.clone(), labels, mask, temperature=0.7)
if rank == 0:
    save_file({"ours": ours, "tp1": tp1.masked_fill(~mask, 0.0), "verl_own": verl_own}, sys.argv[1])
dist.barrier()
dist.destroy_process_group()
