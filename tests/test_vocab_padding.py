"""Megatron-LM's vocab padding (make_vocab_size_divisible_by=128 x TP: a different padded size per
TP) under the patches: the loss from GPTModel.forward(labels=...) and the logprobs are bitwise
equal at TP 1, 2 and 4 for the same logical weights, whether the padded rows hold zeros or random
values; the true vocab size comes from the model config or the explicit setting, and an unknown
one is refused naming the setting. One torchrun launch; the tests assert on its saved results."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import bits_equal, explain, run_torchrun

from mindspeed_tp import ConfigError

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
            assert bits_equal(tensors[f"{key}/loss"], ref), key  # per-token loss = -logprob
            assert bits_equal(tensors[f"{key}/mean_loss"], tensors[f"{vocab}/zero/tp1/mean_loss"]), key


@pytest.mark.parametrize("vocab", VOCABS)
def test_explicit_vocab_size_equals_the_config_one(saved, vocab):
    tensors, _ = saved
    for tp in (1, 2, 4):
        assert bits_equal(tensors[f"{vocab}/explicit/tp{tp}/loss"], tensors[f"{vocab}/zero/tp1/loss"])


def test_unknown_true_vocab_size_is_refused_naming_the_setting(saved):
    _, notes = saved
    assert len(notes) == 3 * len(VOCABS)
    for key, message in notes.items():
        assert "set_vocab_size" in message and "MINDSPEED_TP_VOCAB_SIZE" in message, (key, message)


def test_verl_logprob_excludes_the_padded_columns_its_logits_carry_and_refuses_without_a_size(monkeypatch):
    """verl's logprob runs outside any model's loss: the true vocab size comes with the logits (the
    mark GPTModel.forward sets) or from the explicit setting; otherwise it is refused by name."""
    from mindspeed_tp import ConfigError, compat, numerics
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.integrations.verl import _verl_logprob
    from mindspeed_tp.kernels import vocab_parallel_logprob
    from mindspeed_tp.models.marks import TRUE_VOCAB_ATTR
    from mindspeed_tp.numerics.canonical.strategy import CanonicalTree

    monkeypatch.setattr(numerics.ACTIVE, "_strategy", CanonicalTree(load_profile("default")))
    monkeypatch.setattr(compat, "tp_group_of", lambda module=None: None)  # one process, no megatron groups
    logprob = _verl_logprob(lambda logits, labels: pytest.fail("verl's own function ran"))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 1000, generator=gen)
    labels = torch.randint(0, 1000, (3, 5), generator=gen)
    padded = torch.cat([logits, torch.full((3, 5, 24), 30.0)], dim=-1)  # mbridge's 1024, padding that would dominate
    setattr(padded, TRUE_VOCAB_ATTR, 1000)
    expected = vocab_parallel_logprob(logits, labels, None, 8, vocab_size=1000)
    assert bits_equal(logprob(padded, labels).view(torch.int32), expected.view(torch.int32))
    with pytest.raises(ConfigError, match="MINDSPEED_TP_VOCAB_SIZE"):
        logprob(padded.clone(), labels)  # a copy carries no mark


def test_a_config_vocab_size_equal_to_the_padded_columns_is_not_taken_as_the_true_one():
    """Issue #43, item 6: a framework storing the padded size in the config's vocab_size got its padded
    columns into the log-softmax without a word. Equal to the logit columns the config's value is
    ambiguous: the explicit setting is required (vocab_size_unknown names it); smaller, it is the true one."""
    import types

    from mindspeed_tp.models.marks import mark_true_vocab, true_vocab_of
    from mindspeed_tp.numerics.vocab import true_vocab_size

    padded = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=1024), vocab_size=1024)
    assert true_vocab_of(padded) is None
    with pytest.raises(ConfigError, match="true \\(unpadded\\) vocab size is unknown"):
        true_vocab_size(1024, from_model=true_vocab_of(padded))
    assert true_vocab_of(types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=1000), vocab_size=1024)) == 1000
    mark_true_vocab(padded, 1024)  # a builder that knows nothing is padded says so
    assert true_vocab_of(padded) == 1024
