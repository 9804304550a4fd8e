"""Megatron-LM's vocab padding (make_vocab_size_divisible_by=128 x TP: a different padded size per
TP) under the patches: the loss from GPTModel.forward(labels=...) and the logprobs are bitwise
equal at TP 1, 2 and 4 for the same logical weights, whether the padded rows hold zeros or random
values; the true vocab size comes from the model config or the explicit setting, and an unknown
one is refused naming the setting. One torchrun launch; the tests assert on its saved results."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import explain, run_torchrun

VOCABS = [1000, 1100, 15193]  # 1100 and 15193 (odd, Qwen3's 151936 scaled down) pad differently at TP 1/2/4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("vocab") / "padding"
    proc = run_torchrun("vocab_padding.py", 4, str(prefix), ",".join(map(str, VOCABS)))
    assert proc.returncode == 0, explain(proc)
    with open(f"{prefix}.json") as f:
        return load_file(f"{prefix}.safetensors"), json.load(f)


@pytest.mark.parametrize("vocab", VOCABS)
def test_padded_sizes_differ_by_tp_as_megatron_pads(saved, vocab):
    tensors, _ = saved
    sizes = [int(tensors[f"{vocab}/zero/tp{tp}/padded"]) for tp in (1, 2, 4)]
    assert all(s >= vocab and s % (128 * tp) == 0 for s, tp in zip(sizes, (1, 2, 4)))
    if vocab != 1000:
        assert len(set(sizes)) > 1, sizes


@pytest.mark.parametrize("vocab", VOCABS)
def test_loss_and_logprobs_bitwise_equal_across_tp_and_padding_fill(saved, vocab):
    tensors, _ = saved
    ref = tensors[f"{vocab}/zero/tp1/loss"]
    assert torch.isfinite(ref).all()
    for fill in ("zero", "random"):
        for tp in (1, 2, 4):
            key = f"{vocab}/{fill}/tp{tp}"
            assert torch.equal(tensors[f"{key}/loss"], ref), key  # per-token loss = -logprob
            assert torch.equal(tensors[f"{key}/mean_loss"], tensors[f"{vocab}/zero/tp1/mean_loss"]), key


@pytest.mark.parametrize("vocab", VOCABS)
def test_explicit_vocab_size_equals_the_config_one(saved, vocab):
    tensors, _ = saved
    for tp in (1, 2, 4):
        assert torch.equal(tensors[f"{vocab}/explicit/tp{tp}/loss"], tensors[f"{vocab}/zero/tp1/loss"])


def test_unknown_true_vocab_size_is_refused_naming_the_setting(saved):
    _, notes = saved
    assert len(notes) == 3 * len(VOCABS)
    for key, message in notes.items():
        assert "set_vocab_size" in message and "MINDSPEED_TP_VOCAB_SIZE" in message, (key, message)
