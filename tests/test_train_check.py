"""``mindspeed-tp train-check``: the patches inside megatron-core's own training machinery (DDP with
buckets and overlap_grad_reduce, the distributed optimizer with overlap_param_gather, no-pipelining /
1F1B / interleaved schedules, finalize_model_grads, several micro-batches, DP=2, the loss from
GPTModel.forward(labels=...)). Step-1 loss and in-step logprobs are bitwise equal to the one-device
run in every layout, vanilla megatron-core's are not, and a few steps lower the loss. Without
bitwise_training (this file) gradients and parameters are close but not bitwise (tests/
test_bitwise_training.py covers the mode that makes them so). One CLI run per model; tests assert on
its JSON report."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import bits_equal, explain, run_cli, run_torchrun, tiered

STEP_KEYS = {"step", "loss", "loss_bitwise_equal", "logprobs_bitwise_equal", "grads_bitwise_equal",
             "params_bitwise_equal", "optimizer_state_bitwise_equal", "grad_norm", "grad_norm_bitwise_equal",
             "grad_norm_max_abs_diff", "grad_max_abs_diff", "param_max_abs_diff", "optimizer_state_max_abs_diff",
             "grads_differ", "params_differ", "optimizer_state_differ"}
RUNS = {
    "dense": ("tiny-dense", ["tp2-sp-pp2", "tp2-pp2-vpp2", "tp2-sp-dp2"]),  # one world of 4
    "moe": ("tiny-moe", ["tp2-sp-ep2", "tp1-ep2-dp2"]),
}
# Layouts whose vanilla forward sums across TP ranks (so its logprobs differ from one device).
VANILLA_DIFFERS = {"tp2-sp-pp2", "tp2-pp2-vpp2", "tp2-sp-dp2", "tp2-sp-ep2"}


@pytest.fixture(scope="module", params=tiered(
    "test_train_check.py: train-check launches (model)", ["dense"], sorted(RUNS),
    "megatron's training machinery (DDP, distributed optimizer, the three schedules, DP) runs in the dense "
    "launch; MoE layouts train bitwise in every step in the CI tier (test_bitwise_moe_training.py)"))
def report(request, tmp_path_factory):
    model, layouts = RUNS[request.param]
    path = tmp_path_factory.mktemp("train") / "report.json"
    proc = run_cli("train-check", "--model", model, "--layouts", ",".join(layouts), "--dtype", "fp32",
                   "--steps", "3", "--global-batch-size", "4", "--micro-batch-size", "1",
                   "--seq-length", "32", "--distributed-optimizer", "--overlap", "--compare-vanilla", "--json", str(path))
    assert proc.returncode in (0, 1) and path.exists(), explain(proc)
    with open(path) as f:
        data = json.load(f)
    return proc, data, layouts


def _rows(data, vanilla):
    return {r["layout"]["name"]: r for r in data["results"] if r["vanilla"] == vanilla}


def test_exit_code_and_report_shape(report):
    proc, data, layouts = report
    assert proc.returncode == 0, explain(proc)
    assert "RESULT: bitwise equal" in proc.stdout
    assert data["all_bitwise_equal"] is True
    assert len(data["results"]) == 2 * len(layouts)
    for r in data["results"]:
        assert {"layout", "vanilla", "steps"} <= set(r)
        assert [s["step"] for s in r["steps"]] == [1, 2, 3]
        for s in r["steps"]:
            assert set(s) == STEP_KEYS
    assert set(data["reference"]) == {"consistent", "vanilla"}
    assert data["bitwise_training"] is False


def test_step1_loss_and_in_step_logprobs_bitwise_in_every_layout(report):
    _, data, layouts = report
    ours = _rows(data, vanilla=False)
    assert sorted(ours) == sorted(layouts)
    for name, r in ours.items():
        first = r["steps"][0]
        assert first["loss_bitwise_equal"] and first["logprobs_bitwise_equal"], name
        assert first["loss"] == data["reference"]["consistent"]["loss"][0], name


def test_vanilla_is_not_bitwise(report):
    _, data, layouts = report
    vanilla = _rows(data, vanilla=True)
    differs = [n for n in layouts if n in VANILLA_DIFFERS]
    assert differs
    for name in differs:
        assert vanilla[name]["steps"][0]["logprobs_bitwise_equal"] is False, name


def test_steps_lower_the_loss_and_stay_close_to_one_device(report):
    _, data, _ = report
    for r in data["results"]:
        losses = [s["loss"] for s in r["steps"]]
        assert losses[2] < losses[1] < losses[0], (r["layout"]["name"], losses)
        for s in r["steps"]:
            # without bitwise_training the reductions of gradients over TP/DP/PP are megatron's: close
            assert 0 <= s["grad_norm_max_abs_diff"] < 1e-2 * s["grad_norm"], (r["layout"]["name"], s)
            assert 0 <= s["param_max_abs_diff"] < 5e-2, (r["layout"]["name"], s)
            assert s["grads_bitwise_equal"] == (s["grads_differ"] == []), (r["layout"]["name"], s["step"])
        if not r["vanilla"] and r["layout"]["tp"] > 1:  # ... and not bitwise where TP splits a backward sum
            assert not r["steps"][0]["grads_bitwise_equal"], r["layout"]["name"]


def test_bad_batch_sizes_are_refused_naming_the_flag():
    proc = run_cli("train-check", "--layouts", "tp1-dp2", "--global-batch-size", "6", "--micro-batch-size", "2")
    assert proc.returncode == 2 and "--global-batch-size" in proc.stderr, explain(proc)
    proc = run_cli("train-check", "--layouts", "tp2-pp2-vpp2", "--global-batch-size", "6", "--micro-batch-size", "2")
    assert proc.returncode == 2 and "multiple of pp" in proc.stderr, explain(proc)


def test_scoring_checker_refuses_training_layouts():
    proc = run_cli("check", "--layouts", "tp1-dp2")
    assert proc.returncode == 2 and "train-check" in proc.stderr, explain(proc)


@pytest.fixture(scope="module")
def recompute_runs(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("recompute") / "runs"
    proc = run_torchrun("train_recompute.py", 2, str(prefix), "tiny-dense", "tp2-sp")
    assert proc.returncode == 0, explain(proc)
    return [load_file(f"{prefix}.rank{r}.safetensors") for r in range(2)]


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recomputation_gives_the_same_bits(recompute_runs, recompute):
    """Recomputed forwards are bitwise the first forwards, so every gradient, parameter, loss and
    logprob of the training run is bitwise the run without recomputation."""
    for saved in recompute_runs:
        keys = [k.split("/", 1)[1] for k in saved if k.startswith("none/")]
        assert len(keys) > 10
        for key in keys:
            assert bits_equal(saved[f"{recompute}/{key}"], saved[f"none/{key}"]), key
        assert saved["none/loss"][1] < saved["none/loss"][0]


def test_the_same_state_is_written_as_the_same_bytes(tmp_path):
    """safetensors orders its metadata map differently from one write to the next (5 writes gave 5
    different files before): the state file sorts its header, so two runs compare file to file."""

    from mindspeed_tp.check.train.state_file import read_state, write_atomically

    tensors = {f"layer{i}.weight": torch.arange(6.0).reshape(2, 3) * i for i in range(6)}
    metadata = {f"key{i}": str(i) for i in range(30)}
    blobs = set()
    for n in range(4):
        keys = sorted(metadata, reverse=bool(n % 2))
        path = tmp_path / f"s{n}.safetensors"
        write_atomically(str(path), dict(sorted(tensors.items(), reverse=bool(n % 2))), {k: metadata[k] for k in keys})
        blobs.add(path.read_bytes())
        loaded, meta = read_state(str(path))
        assert meta["key7"] == "7" and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert len(blobs) == 1


def test_a_released_training_model_and_its_optimizer_are_freed():
    """A process that trains several layouts or modes (train-check's worlds, rl-check's two arms,
    scale_bench's modes) gets each model's memory back: without release_models megatron's DDP and
    distributed optimizer stay alive after every reference is dropped (the worker shows that too,
    so the check can fail), with it they are collected -- a dense model under mindspeed-tp and a MoE
    model under vanilla megatron-core (its token dispatcher keeps the last step's graph)."""
    result = run_torchrun("release_models.py", 1, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for model in ("tiny-dense", "tiny-moe"):
        assert f"{model} released: FREED" in result.stdout, result.stdout[-2000:]
        assert f"{model} not released: ALIVE" in result.stdout, result.stdout[-2000:]
