"""Bitwise training of MoE models (``numerics/bitwise_training/experts.py``): with the same global batch,
every layout's loss, gradients, parameters and optimizer state are ``torch.equal`` to the one-device
run after every step -- router weights, routed experts (fc1 gated, fc2), shared experts, the aux and
z-loss gradients -- across EP x expert-TP x SP x PP x DP: bf16 with the distributed optimizer,
overlapped reductions, full recompute and the alltoall dispatcher (tiny-moe-aux: both router losses
on); fp32 with the plain optimizer (dense and expert norms from different groups), selective
recompute and the allgather dispatcher (tiny-moe-shared: sigmoid router with an expert bias, a
shared expert, a dense first layer; both router losses on too). 3 Adam steps with clipping; vanilla megatron-core is not
bitwise. microbatch_groups: 4, so DP=4 layouts run. One train-check launch per dtype."""
import os

import pytest
import torch

from conftest import (bits_equal, explain, full_tier, main_line, run_cli, run_train_check, tiered,
                      train_check_rows)

# The CI tier: EP with TP+SP and EP across DP (the version-line test's layouts).
LAYOUTS = tiered("test_bitwise_moe_training.py: bf16 launch's layouts", ["tp2-sp-ep2", "tp1-ep2-dp2"],
                 ["tp2-sp-ep2", "tp1-ep4", "tp1-ep2-dp2", "tp2-sp-ep2-etp2", "tp2-sp-pp2-ep2", "tp1-ep2-pp2-dp2"],
                 "EP with TP+SP and across DP (the router losses' scale over DP); expert-TP: the fp32 launch; "
                 "pipelines: the dense launch, their stages hold whole MoE layers")
RUNS = {
    "bf16": ("tiny-moe-aux", LAYOUTS, ["--distributed-optimizer", "--overlap", "--recompute", "full",
                                       "--compare-vanilla"]),
    "fp32": ("tiny-moe-shared+losses", tiered("test_bitwise_moe_training.py: fp32 launch's layouts",
                                              ["tp2-sp-ep2-etp2"], ["tp1-ep4", "tp2-sp-ep2-etp2"],
                                              "expert-TP with EP and SP: the allgather dispatcher, the shared "
                                              "expert and both optimizers' groups; EP 4 alone moves rows only"),
             ["--dispatcher", "allgather", "--recompute", "selective"]),
}
# tiny-moe-shared with megatron's router losses on (its sigmoid scores feed them)
ROUTER_LOSSES = "moe_aux_loss_coeff: 0.01\nmoe_router_load_balancing_type: aux_loss\nmoe_z_loss_coeff: 0.001\n"
VERDICTS = ("loss_bitwise_equal", "grads_bitwise_equal", "params_bitwise_equal", "optimizer_state_bitwise_equal",
            "grad_norm_bitwise_equal")
BATCH = ["--global-batch-size", "4", "--micro-batch-size", "1", "--seq-length", "32"]
G4 = "name: bitwise-g4\nbitwise_training: true\nmicrobatch_groups: 4\n"


def _names(layouts):
    """The report's names: a layout naming no dpN runs with the DP its expert grid needs."""
    from mindspeed_tp.check.train.main import parse_layouts

    return sorted(layout.name for layout in parse_layouts(",".join(layouts)))


_reports = {}


def _report(dtype, tmp_path_factory):
    if dtype not in _reports:
        tmp = tmp_path_factory.mktemp("bitwise-moe")
        profile, path = tmp / "g4.yaml", tmp / "report.json"
        profile.write_text(G4)
        model, layouts, flags = RUNS[dtype]
        if model.endswith("+losses"):
            import mindspeed_tp

            bundled = os.path.join(os.path.dirname(mindspeed_tp.__file__), "configs", "models", "tiny-moe-shared.yaml")
            with open(bundled) as f:
                text = f.read().replace("name: tiny-moe-shared", "name: tiny-moe-shared-losses")
            model = str(tmp / "tiny-moe-shared-losses.yaml")
            with open(model, "w") as f:
                f.write(text + ROUTER_LOSSES)
        proc, data = run_train_check(path, "--model", model, "--profile", str(profile), "--layouts", ",".join(layouts),
                                     "--dtype", dtype, "--steps", "3", *BATCH, *flags)
        _reports[dtype] = dtype, proc, data
    return _reports[dtype]


@pytest.fixture(params=sorted(RUNS))
def report(request, tmp_path_factory):
    return _report(request.param, tmp_path_factory)


_rows = train_check_rows


def test_every_moe_step_bitwise_in_every_layout(report):
    dtype, proc, data = report
    assert proc.returncode == 0, explain(proc)
    assert data["bitwise_training"] is True and data["all_bitwise_equal"] is True
    ours = _rows(data, vanilla=False)
    assert sorted(ours) == _names(RUNS[dtype][1])
    for name, row in ours.items():
        assert row["dtype"] == dtype and [s["step"] for s in row["steps"]] == [1, 2, 3]
        for s in row["steps"]:
            bad = [k for k in VERDICTS if not s[k]]
            assert not bad, (name, s["step"], bad, s["grads_differ"][:3], s["optimizer_state_differ"][:3])
            assert s["grads_differ"] == [] and s["params_differ"] == [] and s["optimizer_state_differ"] == []
    losses = data["reference"]["consistent"]["loss"]
    assert losses[2] < losses[0]


def test_vanilla_moe_training_differs_in_every_layout(tmp_path_factory):
    _, _, data = _report("bf16", tmp_path_factory)
    vanilla = _rows(data, vanilla=True)
    assert sorted(vanilla) == _names(LAYOUTS)
    for name, row in vanilla.items():
        assert any(s["grads_differ"] for s in row["steps"]), name


@full_tier(covered_by="tests/test_bitwise_training.py::"
                      "test_a_killed_rank_ends_the_run_and_it_resumes_on_another_layout_with_the_same_bits",
           why="resharding a saved state onto another layout (the same --save-state / --load-state file); "
               "the MoE-specific part, experts gathered from their EP ranks, is what only this test adds")
def test_moe_state_saved_at_ep4_continues_at_tp2_sp_ep2_as_one_device(tmp_path):
    """Resharding: 2 steps at tp1-ep4 (DP 4), --save-state (expert weights gathered from their EP
    ranks, the routers' expert biases included), 2 steps at tp2-sp-ep2 (DP 1) from it: the final
    state is bitwise 4 uninterrupted steps on one device."""
    from safetensors.torch import load_file

    profile = tmp_path / "g4.yaml"
    profile.write_text(G4)
    common = ["--model", "tiny-moe-shared", "--profile", str(profile), "--dtype", "bf16", *BATCH]
    paths = {k: str(tmp_path / f"{k}.safetensors") for k in ("straight", "half", "resumed")}
    runs = [["--layouts", "tp1", "--steps", "4", "--save-state", paths["straight"]],
            ["--layouts", "tp1-ep4", "--steps", "2", "--save-state", paths["half"]],
            ["--layouts", "tp2-sp-ep2", "--steps", "2", "--load-state", paths["half"], "--save-state",
             paths["resumed"]]]
    for args in runs:
        proc = run_cli("train-check", *common, *args, timeout=900)
        assert proc.returncode == 0, explain(proc)
    straight, resumed, half = (load_file(paths[k]) for k in ("straight", "resumed", "half"))
    assert sorted(straight) == sorted(resumed)
    assert any(k.startswith("exp_avg_sq/") and ".local_experts." in k for k in straight)
    assert any(k.startswith("buffer/") and k.endswith("expert_bias") for k in straight)
    assert [k for k in straight if not bits_equal(straight[k], resumed[k])] == []
    moved = [k for k in straight if k.startswith("param/") and not bits_equal(straight[k], half[k])]
    assert moved  # the last two steps trained on


@pytest.mark.version_lines
def test_bitwise_moe_training_on_this_megatron_line(tmp_path, tmp_path_factory):
    """The router losses' scaling, the expert-parallel buffers and the chained optimizer differ by
    line: one small run per line, SP with EP, and EP across DP. With the whole matrix (the main line)
    the bf16 launch runs these layouts with these flags among others: its rows are checked, no launch
    of its own."""
    layouts, flags = ["tp2-sp-ep2", "tp1-ep2-dp2"], ["--distributed-optimizer"]
    if main_line():
        _, proc, data = _report("bf16", tmp_path_factory)
        assert set(layouts) <= set(LAYOUTS) and set(flags) <= set(RUNS["bf16"][2])
    else:
        proc, data = run_train_check(tmp_path / "report.json", "--model", "tiny-moe-aux", "--layouts",
                                     ",".join(layouts), "--dtype", "bf16", "--steps", "2", *BATCH,
                                     "--bitwise-training", *flags)
    assert proc.returncode == 0, explain(proc)
    assert data["all_bitwise_equal"] is True
    assert set(_names(layouts)) <= set(_rows(data, vanilla=False))


# ---- in-process: refusals, the router losses' scale, the chained norm ----

def _moe_model(**config):
    from types import SimpleNamespace

    base = dict(num_moe_experts=8, tensor_model_parallel_size=2, expert_model_parallel_size=2,
                expert_tensor_parallel_size=1, context_parallel_size=1)
    model = torch.nn.Module()
    model.config = SimpleNamespace(**{**base, **config})
    return model


def test_refusals_of_moe_layouts_the_mode_does_not_cover():
    from types import SimpleNamespace

    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.numerics.bitwise_training.patches import check_ddp

    ddp = SimpleNamespace(num_distributed_optimizer_instances=1)
    check_ddp(_moe_model(), ddp)  # EP x ETP = TP: each micro-batch's SP slices meet in one expert group
    check_ddp(_moe_model(tensor_model_parallel_size=1, expert_model_parallel_size=4), ddp)
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size"):  # tp2-sp with EP 1, ETP 1
        check_ddp(_moe_model(expert_model_parallel_size=1), ddp)
    with pytest.raises(ConfigError, match="context_parallel_size"):
        check_ddp(_moe_model(context_parallel_size=2), ddp)


class _Router:
    """megatron's router as ``router_losses`` uses it: ``routing`` (here the logits times 3 as the
    probabilities, recording whether it ran per-token) and the per-token flag it keeps."""

    def __init__(self, balancing="aux_loss", per_token=True):
        from types import SimpleNamespace

        self.config = SimpleNamespace(moe_router_load_balancing_type=balancing, calculate_per_token_loss=per_token)
        self.calculate_per_token_loss = per_token
        self.seen = []

    def routing(self, logits, padding_mask=None):
        self.seen.append(self.calculate_per_token_loss)
        return logits * 3.0, None


@pytest.mark.parametrize("balancing", ["seq_aux_loss", "global_aux_loss"])
def test_router_losses_without_a_layout_free_scale_are_refused(balancing):
    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.numerics.bitwise_training.experts import router_losses

    with pytest.raises(ConfigError, match="moe_router_load_balancing_type"):
        router_losses(_Router(balancing), torch.zeros(4, 1, 8), None, None)


@pytest.mark.parametrize("per_token, padded", [(True, False), (True, True), (False, False)])
def test_router_losses_run_the_plain_path_times_the_micro_batch_tokens(per_token, padded):
    """Per-token loss: megatron's router runs its plain path (the same gradient in every layout and
    megatron-core line) and that gradient is multiplied by the micro-batch's token count, padding
    excluded; its flag is restored. Without per-token loss: untouched."""
    from mindspeed_tp.numerics.bitwise_training.experts import router_losses

    router = _Router(per_token=per_token)
    logits = torch.randn(4, 2, 8, requires_grad=True)
    padding = torch.tensor([[False, False], [False, True], [False, True], [False, False]]) if padded else None
    grad = torch.randn(4, 2, 8)
    out = router_losses(router, logits, padding, None)
    assert router.seen == [False]  # megatron's plain path in both cases
    assert router.calculate_per_token_loss is per_token
    out.backward(grad)
    tokens = (6.0 if padded else 8.0) if per_token else 1.0
    assert bits_equal(logits.grad, (grad * 3.0) * tokens)


def test_chained_norm_of_optimizers_on_different_groups_is_rounded_once(monkeypatch):
    """Dense and expert optimizers whose norms reduce over different groups: megatron's
    sqrt(a^2 + b^2) of the two rounded norms differs from one device's single optimizer; the exact
    sums added before the one rounding do not."""
    import math
    from types import SimpleNamespace

    from mindspeed_tp import numerics
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.numerics.bitwise_training.grad_norm import grad_norm
    from mindspeed_tp.numerics.bitwise_training.patches import chained_grad_norm
    from mindspeed_tp.numerics.bitwise_training.strategy import BitwiseTraining

    monkeypatch.setattr(numerics.ACTIVE, "_strategy", BitwiseTraining(load_profile("default").replace(
        bitwise_training=True)))
    gen = torch.Generator().manual_seed(0)
    mismatches = 0
    for _ in range(64):
        a, b = torch.randn(37, generator=gen), torch.randn(11, generator=gen) * 1e-3
        opts = [SimpleNamespace(get_main_grads_for_grad_norm=lambda g=g: [g], get_grad_stats_parallel_group=lambda: None)
                for g in (a, b)]
        chained = SimpleNamespace(chained_optimizers=opts, grads_states_parallel_group_is_shared=lambda: False)
        ours = chained_grad_norm(lambda self: None)(chained)
        one_device = grad_norm([a, b], None, "cpu")
        assert ours == one_device
        megatron = math.sqrt(grad_norm([a], None, "cpu") ** 2 + grad_norm([b], None, "cpu") ** 2)
        mismatches += megatron != one_device
    assert mismatches  # the case the patch exists for does occur
