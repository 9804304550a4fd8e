"""MoE router losses under the patches: megatron's own aux_loss, seq_aux_loss, global_aux_loss (where
the installed megatron-core has it) and z-loss, at coefficients 0.01 and 0.1. Their values (megatron's
aux-loss tracker) and every gradient, the router's included, equal vanilla megatron-core's within
fp32 round-off; the losses really reach the router (its gradient moves with the coefficient); the
forward logprobs stay bitwise across layouts and unchanged by the losses. One torchrun launch."""
import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_grads_match_vanilla, bits_equal, explain, run_torchrun


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("moe_aux") / "aux"
    proc = run_torchrun("moe_aux.py", 2, str(prefix))
    assert proc.returncode == 0, explain(proc)
    return [load_file(f"{prefix}.rank{r}.safetensors") for r in range(2)]


def _variants(saved):
    return sorted({k.split("/")[0] for k in saved} - {"none"})


def _tracked(saved, variant, mode):
    prefix = f"{variant}/{mode}/tracker/"
    return {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}


def test_every_loss_kind_and_both_coefficients_ran(ranks):
    variants = _variants(ranks[0])
    for kind in ("aux_loss", "seq_aux_loss", "z_loss"):
        assert {f"{kind}-0.01", f"{kind}-0.1"} <= set(variants), variants
    assert "aux_and_z_loss-bundled" in variants  # the bundled tiny-moe-aux


def test_router_loss_values_equal_vanilla(ranks):
    names = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
             "global_aux_loss": "global_load_balancing_loss", "z_loss": "z_loss",
             "aux_and_z_loss": "load_balancing_loss"}
    for saved in ranks:
        for variant in _variants(saved):
            ours, theirs = _tracked(saved, variant, "consistent"), _tracked(saved, variant, "vanilla")
            assert set(ours) == set(theirs)
            name = names[variant.split("-")[0]]
            if name not in theirs:  # megatron-core 0.12 logs the sequence aux loss as load_balancing_loss
                name = "load_balancing_loss"
            assert (theirs[name] > 0).all(), (variant, theirs)  # one value per MoE layer, all present
            if variant.startswith("aux_and_z_loss"):
                assert (theirs["z_loss"] > 0).all(), theirs
            for key in theirs:
                torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-7, msg=f"{variant} {key}")


def test_gradients_equal_vanilla_router_included(ranks):
    for saved in ranks:
        for variant in _variants(saved) + ["none"]:
            sub = {k[len(variant) + 1:]: v for k, v in saved.items() if k.startswith(variant + "/")}
            assert_grads_match_vanilla(sub, "consistent", variant)
            assert any("router.weight" in k for k in sub if k.startswith("consistent/grad/"))


def test_the_losses_reach_the_router(ranks):
    saved = ranks[0]
    routers = [k.split("/grad/")[1] for k in saved if k.startswith("none/consistent/grad/") and "router.weight" in k]
    assert routers
    for variant in _variants(saved):
        kind, coeff = variant.split("-")
        if coeff != "0.1":
            continue
        moved = [float((saved[f"{variant}/consistent/grad/{r}"] - saved[f"none/consistent/grad/{r}"]).norm())
                 for r in routers]
        small = [float((saved[f"{kind}-0.01/consistent/grad/{r}"] - saved[f"none/consistent/grad/{r}"]).norm())
                 for r in routers]
        assert all(m > 1e-4 for m in moved), (variant, moved)
        assert sum(moved) > 5 * sum(small), (variant, moved, small)  # ~10x the coefficient, ~10x the change


def test_forward_logprobs_stay_bitwise(ranks):
    for saved in ranks:
        reference = saved["none/consistent/per_token/tp1"]
        for variant in _variants(saved) + ["none"]:
            assert bits_equal(saved[f"{variant}/consistent/per_token/tp2-sp-ep2"], reference), variant
            assert bits_equal(saved[f"{variant}/consistent/per_token/tp1"], reference), variant
