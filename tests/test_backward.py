"""Backward still works under the patches: gradients match vanilla megatron-core (fp32; dense at
TP=2 with SP, MoE at TP=2/EP=2 with SP) within fp32 round-off, and Adam steps lower the loss."""
import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_grads_match_vanilla, bits_equal, explain, run_torchrun, tiered


@pytest.fixture(scope="module", params=tiered(
    "test_backward.py: torchrun launches (model, layout)", [("tiny-dense", "tp2-sp")],
    [("tiny-dense", "tp2-sp"), ("tiny-moe-shared", "tp2-sp-ep2")],
    "the plain backward of the patched linears, norm and attention at TP+SP; MoE gradients at TP+SP+EP are "
    "bitwise one device's in every step in the CI tier (test_bitwise_moe_training.py)"),
    ids=lambda p: f"{'dense' if p[0] == 'tiny-dense' else 'moe'}-{p[1]}")
def ranks(request, tmp_path_factory):
    model, layout = request.param
    prefix = tmp_path_factory.mktemp("backward") / "grads"
    proc = run_torchrun("backward.py", 2, str(prefix), model, layout)
    assert proc.returncode == 0, explain(proc)
    return [load_file(f"{prefix}.rank{r}.safetensors") for r in range(2)]


def test_gradients_match_vanilla_within_fp32_roundoff(ranks):
    for t in ranks:
        assert_grads_match_vanilla(t, "consistent")


def test_optimizer_steps_lower_the_loss(ranks):
    losses = ranks[0]["consistent/train_losses"]
    assert torch.all(losses[1:] < losses[:-1]), losses
    assert bits_equal(losses, ranks[1]["consistent/train_losses"])  # TP ranks see one loss
