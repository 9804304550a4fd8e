"""Worker (torchrun, 2 processes): a training-style forward, GPTModel.forward(labels=...), which
megatron-core turns into a loss through vocab_parallel_cross_entropy (0.19 passes tp_group=). Saves,
per layout (tp1, tp2-sp), the loss and -logprob of the same tokens from the logits forward."""
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

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

init_distributed()
install_cpu_shims()
spec, profile = load_model_spec("tiny-dense"), load_profile()
mindspeed_tp.enable(profile)
mindspeed_tp.set_vocab_size(spec.vocab_size)  # the true vocab (the model pads it to 1024)
batch = make_batch(spec.vocab_size, 5, 3, 48)
b, s = batch.tokens.shape
positions = torch.arange(s).unsqueeze(0).expand(b, s)
mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
out = {}
for name in ("tp1", "tp2-sp"):
    layout = Layout.parse(name)
    setup_parallel_state(layout, 0)
    model = build_gpt_stage(spec, layout, torch.bfloat16, profile)
    load_seeded_weights(model, spec, 0, layout)
    with torch.no_grad():
        loss = model(batch.tokens, positions, mask, labels=batch.targets)
        logits = model(batch.tokens, positions, mask)
        from megatron.core import tensor_parallel

        # what the labels path must equal: the patched cross entropy of the fp32 logits, (b, s)
        direct = tensor_parallel.vocab_parallel_cross_entropy(logits.float().transpose(0, 1).contiguous(),
                                                              batch.targets.t().contiguous()).t()
    out[f"{name}/loss"] = loss.float().contiguous()
    out[f"{name}/direct"] = direct.float().contiguous()
if dist.get_rank() == 0:
    save_file(out, sys.argv[1])
finish_worker()
