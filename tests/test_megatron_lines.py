"""What differs between the supported megatron-core lines (0.12.x, 0.16.x, 0.19.x), checked against
the installed one: every argument the installed megatron-core can pass to a replaced function is in
the replacement's own signature (honoured or refused there, never swallowed by **kwargs), 0.19's
gtp_remat_size above 1 is refused, and a training-style GPTModel.forward(labels=...) -- megatron's
own loss path through vocab_parallel_cross_entropy (0.19 passes tp_group=) -- is bitwise the same
at TP=2/SP as at TP=1 and equals the patched cross entropy of the logits."""
import inspect

import pytest
import torch
from safetensors.torch import load_file

from conftest import bits_equal, explain, run_torchrun

pytestmark = pytest.mark.version_lines


def _plain_patches():
    """(target, original, replacement) of every patch that replaces a function outright."""
    import mindspeed_tp
    from mindspeed_tp.patches import registry

    mindspeed_tp.enable()
    return [(p.target, p._original, p.replacement) for p in registry().patches if p.applied and not p.wraps]


def test_replacements_take_every_argument_the_installed_megatron_core_passes():
    checked = 0
    for target, original, replacement in _plain_patches():
        original = getattr(original, "__func__", original)
        theirs = inspect.signature(original).parameters
        ours = inspect.signature(replacement).parameters
        if any(p.kind is p.VAR_KEYWORD for p in theirs.values()):
            continue  # the original itself forwards **kwargs: nothing named to honour
        assert not any(p.kind is p.VAR_KEYWORD for p in ours.values()), f"{target}: **kwargs would swallow arguments"
        missing = [name for name in theirs if name not in ours]
        assert not missing, f"{target}: megatron-core passes {missing}, which the replacement does not take"
        checked += 1
    assert checked >= 5


def test_gtp_remat_size_above_one_is_refused():
    from mindspeed_tp import ConfigError
    from mindspeed_tp.patches.tensor_parallel import consistent_linear

    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ConfigError, match="gtp_remat_size"):
        consistent_linear(x, w, None, gtp_remat_size=2)


def test_cross_entropy_takes_tp_group():
    """0.19's GPTModel passes tp_group=; the patched function must use it (a world of one here)."""
    from mindspeed_tp.patches.tensor_parallel import vocab_parallel_cross_entropy

    assert "tp_group" in inspect.signature(vocab_parallel_cross_entropy).parameters


@pytest.fixture(scope="module")
def labels_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("labels") / "labels.safetensors"
    proc = run_torchrun("labels_forward.py", 2, str(path))
    assert proc.returncode == 0, explain(proc)
    return load_file(str(path))


def test_forward_with_labels_is_layout_invariant(labels_run):
    loss = labels_run["tp2-sp/loss"]
    assert loss.shape == (3, 48) and torch.isfinite(loss).all() and (loss > 0).all()
    assert bits_equal(loss, labels_run["tp1/loss"])


@pytest.mark.parametrize("layout", ["tp1", "tp2-sp"])
def test_forward_with_labels_goes_through_the_patched_cross_entropy(labels_run, layout):
    assert bits_equal(labels_run[f"{layout}/loss"], labels_run[f"{layout}/direct"])
