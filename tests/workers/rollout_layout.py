"""Worker (torchrun, world 4): the rollout-layout mode on real megatron-core GPTModels.

Usage: rollout_layout.py OUT_PREFIX MODEL LAYOUTS GRAD_LAYOUT
- bf16: for the profiles rollout-tp1 and rollout-tp2, the single-device reference model running as
  a stock engine at TP=R scores a seeded batch; every layout in LAYOUTS scores it with the
  patched Megatron forward, under no_grad and with grad enabled (training mode, parameters
  requiring grad). Also the canonical-tree profile at tp1 and tp2 against the stock TP=1 engine.
- fp32, GRAD_LAYOUT: parameter gradients of the rollout-tp2 mode, the canonical-tree mode and
  vanilla megatron-core;
  then the re-laid weight cache across an optimizer step (cached vs uncached forward).
Rank 0 saves the logprobs; every rank saves its gradients.
"""
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from grad_helpers import finalize_grads, scored_loss, with_ddp

import mindspeed_tp
from mindspeed_tp.numerics.rollout_layout import linear as rollout_layout
from mindspeed_tp.numerics.rollout_layout import relayout
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.check.batch import make_batch
from mindspeed_tp.check.driver import init_distributed, logprobs_from_logits, pipeline_forward, setup_parallel_state
from mindspeed_tp.check.harness import layout_logprobs
from mindspeed_tp.check.builder import build_gpt_stage
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.spec import load_model_spec
from mindspeed_tp.models.weights import load_seeded_weights
from mindspeed_tp.contract.profile import load_profile
from mindspeed_tp.reference import ReferenceModel
from mindspeed_tp.reference.model import whole_sequence_kv
from worker_exit import finish_worker

out_prefix, model_name, layout_names, grad_layout_name = sys.argv[1:5]
init_distributed()
install_cpu_shims()

SEED = 5
# Several token chunks per scoring call, the last one uneven, so the chunked exchange is exercised.
rollout_layout.LOGPROB_CHUNK_TOKENS = 100
spec = load_model_spec(model_name)
batch = make_batch(spec.vocab_size, SEED, 3, 136)
rank = dist.get_rank()
out = {"scored": batch.scored}
stock = {name: load_profile(name) for name in ("rollout-tp1", "rollout-tp2")}
tree = load_profile("default")


def engine_logprobs(profile, dtype):
    """The stock engine at TP=R (reference model): each sequence prefilled as one request."""
    model = ReferenceModel.seeded(spec, profile, SEED, dtype)
    b, s = batch.tokens.shape
    result = torch.zeros(b, s)
    for i in range(b):
        logits = model.forward(batch.tokens[i], torch.arange(s), [(0, s)], *whole_sequence_kv())
        result[i] = model.logprob(logits, batch.targets[i])
    return result


def fresh_model(layout, profile, dtype, train):
    setup_parallel_state(layout, SEED)
    model = build_gpt_stage(spec, layout, dtype, profile)
    load_seeded_weights(model, spec, SEED, layout)
    model.train(train)
    return model


def logprobs_with_grad(layout, profile):
    """Scored with autograd recording (training mode); every TP rank holds every token's logprob."""
    mindspeed_tp.enable(profile)
    model = fresh_model(layout, profile, torch.bfloat16, True)
    logits = pipeline_forward(model, layout, batch, spec.hidden_size, torch.bfloat16)
    lp = logprobs_from_logits(logits, batch, spec.vocab_size)
    assert lp.requires_grad
    return lp.detach()


for name, prof in stock.items():
    out[f"engine/{name}"] = engine_logprobs(prof, torch.bfloat16)
for layout_name in layout_names.split(","):
    layout = Layout.parse(layout_name)
    for name, prof in stock.items():
        out[f"nograd/{name}/{layout_name}"] = layout_logprobs(spec, layout, torch.bfloat16, prof, SEED, batch, False)[0]
        if layout.pp == 1:
            out[f"grad/{name}/{layout_name}"] = logprobs_with_grad(layout, prof)
for layout_name in ("tp1", "tp2-sp" if not spec.is_moe else "tp2-sp-ep2"):
    out[f"tree/{layout_name}"] = layout_logprobs(spec, Layout.parse(layout_name), torch.bfloat16, tree, SEED, batch,
                                                 False)[0]

# fp32 gradients: rollout-layout (R=2) vs vanilla megatron-core, same weights and batch.
grad_layout = Layout.parse(grad_layout_name)


def loss_of(model):
    return scored_loss(model, grad_layout, batch, spec, torch.float32)


grads = {}
for mode, prof in (("vanilla", None), ("rollout", stock["rollout-tp2"]), ("tree", tree)):
    mindspeed_tp.disable() if prof is None else mindspeed_tp.enable(prof)
    model = fresh_model(grad_layout, stock["rollout-tp2"], torch.float32, True)
    ddp = with_ddp(model)
    loss = loss_of(model)
    loss.backward()
    grads[f"{mode}/loss"] = loss.detach().reshape(1)
    for pname, grad in finalize_grads(ddp).items():
        grads[f"{mode}/grad/{pname}"] = grad

# The cache: filled by a forward; refreshed by an optimizer step even when the step writes through
# ``.data`` (as Megatron copies main params into model params: no autograd version bump), and by
# an explicit invalidation; a ``.data`` edit without either leaves it stale (so it is really used).


class DataSGD(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def uncached_loss(model):
    relayout.set_relaid_cache(False)
    value = loss_of(model)
    relayout.set_relaid_cache(True)
    return value


mindspeed_tp.enable(stock["rollout-tp2"])
model = fresh_model(grad_layout, stock["rollout-tp2"], torch.float32, True)
with torch.no_grad():
    before = loss_of(model)
    cached_bytes = relayout.relaid_cache_bytes()
loss = loss_of(model)
loss.backward()
DataSGD(model.parameters(), lr=0.5).step()
with torch.no_grad():
    after_step, after_step_uncached = loss_of(model), uncached_loss(model)
    loss_of(model)  # cache filled again
    for p in model.parameters():
        p.data.mul_(0.5)
    stale = loss_of(model)
    relayout.invalidate_relaid_weights()
    fresh, edit_uncached = loss_of(model), uncached_loss(model)
    # Checking (MINDSPEED_TP_CHECK_WEIGHT_CACHES=1): a .data edit behind the cache is refused, not used;
    # a state dict loaded into the same parameters refreshes it.
    os.environ["MINDSPEED_TP_CHECK_WEIGHT_CACHES"] = "1"
    loss_of(model)  # entries with checksums
    for p in model.parameters():
        p.data.mul_(2.0)
    try:
        loss_of(model)
        stale_refused = 0
    except mindspeed_tp.ConfigError as exc:
        stale_refused = int("invalidate_weight_caches" in str(exc))
    del os.environ["MINDSPEED_TP_CHECK_WEIGHT_CACHES"]
    mindspeed_tp.invalidate_weight_caches()
    loss_of(model)  # cached again
    halved = {k: v * 0.5 if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in model.state_dict().items()}
    model.load_state_dict(halved)
    loaded, loaded_uncached = loss_of(model), uncached_loss(model)
grads["cache/stale_refused"] = torch.tensor([stale_refused])
grads["cache/loaded"] = torch.stack([loaded, loaded_uncached]).reshape(2)
grads["cache/bytes"] = torch.tensor([cached_bytes], dtype=torch.int64)
grads["cache/weight_bytes"] = torch.tensor([sum(p.numel() * p.element_size() for p in model.parameters())])
grads["cache/losses"] = torch.stack([before, after_step, after_step_uncached, stale, fresh, edit_uncached]).reshape(6)

save_file({k: v.contiguous() for k, v in grads.items()}, f"{out_prefix}.grads.rank{rank}.safetensors")
if rank == 0:
    save_file({k: v.contiguous() for k, v in out.items()}, f"{out_prefix}.logprobs.safetensors")
finish_worker()
