"""Worker (torchrun, 2 processes): tiny-moe with megatron's router losses on (aux_loss,
seq_aux_loss, global_aux_loss where the installed megatron-core has it, z-loss; coefficients 0.01
and 0.1), fp32, training mode, through megatron's DDP and finalize_model_grads. For each variant
and mode (vanilla, mindspeed-tp) at tp2-sp-ep2: the main loss from GPTModel.forward(labels=...),
megatron's aux-loss tracker values, every gradient; and mindspeed-tp's per-token loss at tp1 and
tp2-sp-ep2 (forward bitwise). Saved per rank."""
import dataclasses
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from grad_helpers import finalize_grads, with_ddp

import mindspeed_tp
from mindspeed_tp.check.batch import make_batch
from mindspeed_tp.check.driver import setup_parallel_state, init_distributed
from mindspeed_tp.check.builder import build_gpt_stage
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.spec import load_model_spec
from mindspeed_tp.models.weights import load_seeded_weights
from mindspeed_tp.compat import megatron_line
from mindspeed_tp.contract.profile import load_profile
from mindspeed_tp.devices.cpu_shims import install_cpu_shims

init_distributed()
install_cpu_shims()
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, clear_aux_losses_tracker  # noqa: E402
from worker_exit import finish_worker

try:  # megatron-core >= 0.13 keeps the tracker in moe_utils, 0.12 in parallel_state
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
except ImportError:
    from megatron.core.parallel_state import get_moe_layer_wise_logging_tracker

profile = load_profile()
# The bundled tiny-moe-aux (aux_loss 0.01 and z-loss 0.001 together), and its variants from a base
# with the router losses off. Unpadded vocab: vanilla megatron's loss includes padded columns in the
# softmax, the patch does not.
bundled = dataclasses.replace(load_model_spec("tiny-moe-aux"), padded_vocab_size=1000)
base = dataclasses.replace(bundled, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, moe_router_load_balancing_type="none")
VARIANTS = {"none": dict(), "aux_and_z_loss-bundled": {f: getattr(bundled, f) for f in (
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type")}}
for coeff in (0.01, 0.1):
    for kind in ("aux_loss", "seq_aux_loss") + (("global_aux_loss",) if megatron_line() >= (0, 16) else ()):
        VARIANTS[f"{kind}-{coeff}"] = dict(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=coeff)
    VARIANTS[f"z_loss-{coeff}"] = dict(moe_z_loss_coeff=coeff)
batch = make_batch(base.vocab_size, 11, 4, 32)
s = batch.tokens.shape[1]
positions = torch.arange(s).unsqueeze(0).expand(4, s)
mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
scored = batch.scored.float()


def run(spec, layout, vanilla, backward):
    mindspeed_tp.disable() if vanilla else mindspeed_tp.enable(profile)
    setup_parallel_state(layout, 0)
    model = build_gpt_stage(spec, layout, torch.float32, profile)
    load_seeded_weights(model, spec, 0, layout)
    model.train()
    ddp = with_ddp(model)
    clear_aux_losses_tracker()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    per_token = model(batch.tokens, positions, mask, labels=batch.targets)
    loss = (per_token * scored).sum() / scored.sum()
    if not backward:
        return per_token.detach(), None, None, None
    loss.backward()
    grads = finalize_grads(ddp)
    tracked = {name: entry["values"].detach().clone() for name, entry in get_moe_layer_wise_logging_tracker().items()}
    return per_token.detach(), loss.detach().reshape(1), tracked, grads


out = {}
tp2 = Layout.parse("tp2-sp-ep2")
for variant, fields in VARIANTS.items():
    spec = dataclasses.replace(base, **fields)
    for mode in ("vanilla", "consistent"):
        _, loss, tracked, grads = run(spec, tp2, mode == "vanilla", backward=True)
        out[f"{variant}/{mode}/loss"] = loss
        out.update({f"{variant}/{mode}/tracker/{k}": v for k, v in tracked.items()})
        out.update({f"{variant}/{mode}/grad/{k}": v for k, v in grads.items()})
    for layout in (Layout(), tp2):  # the forward with the router losses attached: still bitwise
        out[f"{variant}/consistent/per_token/{layout.name}"] = run(spec, layout, False, backward=False)[0]
save_file({k: v.contiguous() for k, v in out.items()}, f"{sys.argv[1]}.rank{dist.get_rank()}.safetensors")
finish_worker()
