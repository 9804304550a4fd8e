"""Worker (torchrun): a bundled GPTModel (default tiny-dense at TP=2 with SP), fp32, training mode.
Saves each rank's parameter gradients for vanilla and patched runs, and the loss over a few
Adam steps with the patches on."""
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from grad_helpers import as_param_grads, finalize_grads, scored_loss, with_ddp, zero_grads

import mindspeed_tp
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.check.batch import make_batch
from mindspeed_tp.check.driver import setup_parallel_state, init_distributed
from mindspeed_tp.check.builder import build_gpt_stage
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.spec import load_model_spec
from mindspeed_tp.models.weights import load_seeded_weights
from mindspeed_tp.contract.profile import load_profile
from worker_exit import finish_worker

out_prefix = sys.argv[1]
model_name = sys.argv[2] if len(sys.argv) > 2 else "tiny-dense"
layout_name = sys.argv[3] if len(sys.argv) > 3 else "tp2-sp"
init_distributed()
install_cpu_shims()
spec, profile, layout = load_model_spec(model_name), load_profile(), Layout.parse(layout_name)
batch = make_batch(spec.vocab_size, 3, 4, 64)


def loss_of(model):
    return scored_loss(model, layout, batch, spec, torch.float32)


def fresh_model():
    setup_parallel_state(layout, 0)
    model = build_gpt_stage(spec, layout, torch.float32, profile)
    load_seeded_weights(model, spec, 0, layout)
    model.train()
    return model, with_ddp(model)


tensors = {}
for mode in ("vanilla", "consistent"):
    mindspeed_tp.disable() if mode == "vanilla" else mindspeed_tp.enable(profile)
    model, ddp = fresh_model()
    loss = loss_of(model)
    loss.backward()
    tensors[f"{mode}/loss"] = loss.detach().reshape(1)
    for name, grad in finalize_grads(ddp).items():
        tensors[f"{mode}/grad/{name}"] = grad

mindspeed_tp.enable(profile)
model, ddp = fresh_model()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
losses = []
for _ in range(6):
    zero_grads(ddp)
    loss = loss_of(model)
    loss.backward()
    as_param_grads(ddp, finalize_grads(ddp))
    opt.step()
    losses.append(loss.detach())
tensors["consistent/train_losses"] = torch.stack(losses)
save_file({k: v.contiguous() for k, v in tensors.items()}, f"{out_prefix}.rank{dist.get_rank()}.safetensors")
finish_worker()
