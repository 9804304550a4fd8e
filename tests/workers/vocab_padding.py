"""Worker (torchrun, 4 processes): a tiny-dense GPTModel whose vocab is padded Megatron-LM's way
(make_vocab_size_divisible_by=128 x TP) at TP 1, 2 and 4, the same logical weights, the padded rows
zero or random; the per-token loss from GPTModel.forward(labels=...) and the logprobs through the
patched cross entropy, saved by rank 0 for each (vocab, fill, tp). Also saves what happens when the
true vocab size is unknown (the refusal message) or given explicitly instead of by the config."""
import dataclasses
import json
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import mindspeed_tp
from mindspeed_tp.models.marks import TRUE_VOCAB_ATTR
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.check.batch import make_batch
from mindspeed_tp.check.driver import setup_parallel_state, init_distributed
from mindspeed_tp.errors import ConfigError
from mindspeed_tp.check.builder import build_gpt_stage
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.spec import load_model_spec
from mindspeed_tp.models.weights import SeededWeights, load_weights
from mindspeed_tp.contract.profile import load_profile
from worker_exit import finish_worker

VOCABS = [int(v) for v in sys.argv[2].split(",")]
MEGATRON_DIVISIBLE_BY = 128


def megatron_padded(vocab: int, tp: int) -> int:
    """Megatron-LM's _vocab_size_with_padding."""
    multiple = MEGATRON_DIVISIBLE_BY * tp
    return -(-vocab // multiple) * multiple


class PaddedVocabWeights(SeededWeights):
    """The seeded weights of the unpadded model; embedding and LM-head rows beyond the true vocab
    are zeros or random (what a checkpoint's padding may hold), whatever the padded size."""

    def __init__(self, spec, seed, fill):
        super().__init__(spec, seed)
        self.fill = fill

    def full(self, name, shape):
        if not name.endswith(("word_embeddings.weight", "output_layer.weight")):
            return super().full(name, shape)
        canonical = super().full(name, (self.spec.padded_vocab(profile), shape[1]))[: self.spec.vocab_size]
        pad = shape[0] - self.spec.vocab_size
        gen = torch.Generator().manual_seed(shape[0] + 17)
        rows = torch.zeros(pad, shape[1]) if self.fill == "zero" else 3.0 * torch.randn(pad, shape[1], generator=gen)
        return torch.cat([canonical, rows])


init_distributed()
install_cpu_shims()
profile = load_profile()
mindspeed_tp.enable(profile)
base = load_model_spec("tiny-dense")
out, notes = {}, {}
for vocab in VOCABS:
    batch = make_batch(vocab, 5, 2, 32)
    s = batch.tokens.shape[1]
    positions = torch.arange(s).unsqueeze(0).expand(2, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    for tp in (1, 2, 4):
        spec = dataclasses.replace(base, name=f"v{vocab}", vocab_size=vocab, padded_vocab_size=megatron_padded(vocab, tp))
        layout = Layout(tp=tp)
        setup_parallel_state(layout, 0)
        for fill in ("zero", "random"):
            model = build_gpt_stage(spec, layout, torch.float32, profile)
            load_weights(model, spec, layout, PaddedVocabWeights(spec, 0, fill))
            with torch.no_grad():
                loss = model(batch.tokens, positions, mask, labels=batch.targets)  # (b, s) per-token loss
            key = f"{vocab}/{fill}/tp{tp}"
            out[f"{key}/loss"] = loss.float()
            out[f"{key}/mean_loss"] = ((loss * batch.scored).sum(1).sum() / batch.scored.sum()).reshape(1)
            out[f"{key}/padded"] = torch.tensor([spec.padded_vocab_size])
        # The same model whose config does not state the true size (nor its builder's mark): refused,
        # or told explicitly.
        del model.config.vocab_size
        delattr(model, TRUE_VOCAB_ATTR)
        try:
            with torch.no_grad():
                model(batch.tokens, positions, mask, labels=batch.targets)
            notes[f"{vocab}/tp{tp}/unknown"] = "accepted"
        except ConfigError as exc:
            notes[f"{vocab}/tp{tp}/unknown"] = str(exc)
        mindspeed_tp.set_vocab_size(vocab)
        with torch.no_grad():
            out[f"{vocab}/explicit/tp{tp}/loss"] = model(batch.tokens, positions, mask, labels=batch.targets).float()
        mindspeed_tp.set_vocab_size(None)
if dist.get_rank() == 0:
    save_file({k: v.contiguous() for k, v in out.items()}, f"{sys.argv[1]}.safetensors")
    with open(f"{sys.argv[1]}.json", "w") as f:
        json.dump(notes, f)
finish_worker()
