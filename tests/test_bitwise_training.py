"""Bitwise training (profile bitwise_training, ``mindspeed-tp train-check --bitwise-training``): with
the same global batch, every layout's loss, every gradient, every parameter and the optimizer state
(Adam's moments and the fp32 main parameters) are ``torch.equal`` to the one-device run after every
step -- each parameter's full logical tensor, compared shard by shard -- for TP in {1, 2, 4} x SP x
PP in {1, 2} (1F1B and interleaved) x DP in {1, 2} in bf16 (distributed optimizer, overlapped grad
reduce and param gather, full recompute), and TP 4 with SP, TP x DP and interleaved PP in fp32 (plain
optimizer, selective recompute: what differs with the dtype is the GEMM kernels and the optimizer,
not the layouts), 3 Adam steps with clipping; vanilla megatron-core is not (bf16). The fp32 launch's
model has an FFN of 200 (activation shards of 100 and 50 columns: the elementwise ops' row tails,
kernels/elementwise.py, in the backward too). One train-check launch per dtype; the refusals and the
exact norm are checked in-process."""
import json
import os
import math
import random
from fractions import Fraction

import pytest
import torch

from conftest import bits_equal, explain, full_tier, main_line, run_cli, run_train_check, tiered, train_check_rows

# The CI tier: TP+SP, DP and PP (with TP+SP) in one world of 4; the version-line test's layouts among them.
LAYOUTS = tiered("test_bitwise_training.py: bf16 launch's layouts", ["tp2-sp", "tp1-dp2", "tp2-sp-pp2"],
                 ["tp2", "tp2-sp", "tp4-sp", "tp1-pp2", "tp1-dp2", "tp2-sp-pp2", "tp2-sp-dp2", "tp2-pp2-vpp2",
                  "tp4-sp-pp2", "tp2-sp-pp2-dp2"],
                 "TP+SP, DP and a pipeline each split the sums; TP 4, interleaved PP and the crossings are the same "
                 "folds (TP 4 and interleaved PP: the fp32 launch's full cases; DP 4 and CP: the tied-embedding launch)")
# Bitwise training at CP rides in the bf16 launch (tests/test_context_parallel.py reads its rows): the
# weight-gradient and token sums gathered over CP, dK/dV over the whole sequence, DP x CP synced over DP.
BITWISE_CP = ["tp2-sp-cp2", "tp1-cp2-dp2", "tp1-cp2-pp2"]
# dtype: (layouts, flags). fp32: the fp32 GEMM and the plain optimizer in every kind of split, TP 4,
# TP x DP and interleaved PP (one world of 4, and the one-device run), on ``_ffn200_model``.
RUNS = {
    "bf16": (LAYOUTS + BITWISE_CP, ["--distributed-optimizer", "--overlap", "--recompute", "full",
                                    "--compare-vanilla"]),
    "fp32": (tiered("test_bitwise_training.py: fp32 launch's layouts", ["tp2-sp-dp2"],
                    ["tp4-sp", "tp2-sp-dp2", "tp2-pp2-vpp2"],
                    "TP x DP with SP: the fp32 GEMM's split sums and the plain optimizer over DP; the layouts "
                    "themselves run in bf16"), ["--recompute", "selective", "--device", "cpu"]),
}
VERDICTS = ("loss_bitwise_equal", "grads_bitwise_equal", "params_bitwise_equal", "optimizer_state_bitwise_equal")
# Layouts splitting a sum over TP or DP ranks (tp1-pp2 splits none; vanilla may or may not match there).
SPLIT_SUMS = [n for n in LAYOUTS if n != "tp1-pp2"]


_reports = {}


def _ffn200_model(directory) -> str:
    """tiny-dense with ffn_hidden_size 200: SwiGLU on shards of 100 (TP 2) and 50 (TP 4) columns,
    widths no CPU vector loop divides."""
    from mindspeed_tp.models.spec import MODEL_DIR

    text = open(os.path.join(MODEL_DIR, "tiny-dense.yaml")).read()
    assert "ffn_hidden_size: 256\n" in text
    path = directory / "tiny-dense-ffn200.yaml"
    path.write_text(text.replace("ffn_hidden_size: 256\n", "ffn_hidden_size: 200\n")
                    .replace("name: tiny-dense\n", "name: tiny-dense-ffn200\n"))
    return str(path)


def _report(dtype, tmp_path_factory):
    """The dtype's one train-check launch, shared by every test of the module (and the bf16 one by
    tests/test_context_parallel.py's CP rows)."""
    if dtype not in _reports:
        path = tmp_path_factory.mktemp("bitwise") / "report.json"
        layouts, flags = RUNS[dtype]
        model = "tiny-dense" if dtype == "bf16" else _ffn200_model(tmp_path_factory.mktemp("model"))
        proc, data = run_train_check(path, "--model", model, "--layouts", ",".join(layouts), "--dtype", dtype,
                                     "--steps", "3", "--global-batch-size", "4", "--micro-batch-size", "1",
                                     "--seq-length", "32", "--bitwise-training", *flags)
        _reports[dtype] = dtype, proc, data
    return _reports[dtype]


@pytest.fixture(params=sorted(RUNS))
def report(request, tmp_path_factory):
    return _report(request.param, tmp_path_factory)


_rows = train_check_rows


def _bitwise_run(tmp_path, model, layouts, *extra, steps="2", global_batch="4"):
    """One train-check launch (32 tokens, micro-batches of 1); returns its JSON report after
    asserting exit 0 and that mindspeed-tp's rows are exactly ``layouts``."""
    path = tmp_path / "report.json"
    proc = run_cli("train-check", "--model", str(model), "--layouts", ",".join(layouts), "--dtype", "bf16",
                   "--steps", steps, "--global-batch-size", global_batch, "--micro-batch-size", "1",
                   "--seq-length", "32", "--json", str(path), *extra)
    assert proc.returncode == 0, explain(proc)
    with open(path) as f:
        data = json.load(f)
    assert data["bitwise_training"] is True and data["all_bitwise_equal"] is True
    assert sorted(_rows(data, vanilla=False)) == sorted(layouts)
    return data


def _assert_every_step_bitwise(data):
    for name, row in _rows(data, vanilla=False).items():
        for s in row["steps"]:
            assert all(s[k] for k in VERDICTS), (name, s["step"], s["grads_differ"][:3])


def test_every_step_bitwise_in_every_layout(report):
    dtype, proc, data = report
    assert proc.returncode == 0, explain(proc)
    assert data["bitwise_training"] is True and data["all_bitwise_equal"] is True and data["device"] == "cpu"
    ours = _rows(data, vanilla=False)
    assert sorted(ours) == sorted(RUNS[dtype][0])
    for name, row in ours.items():
        assert row["dtype"] == dtype
        assert [s["step"] for s in row["steps"]] == [1, 2, 3]
        for s in row["steps"]:
            bad = [k for k in VERDICTS if not s[k]]
            assert not bad, (name, s["step"], bad, s["grads_differ"][:3], s["optimizer_state_differ"][:3])
            assert s["grads_differ"] == [] and s["params_differ"] == [] and s["optimizer_state_differ"] == []
            assert s["grad_max_abs_diff"] == 0.0 and s["param_max_abs_diff"] == 0.0
            assert s["grad_norm_bitwise_equal"], (name, s["step"])


def test_training_moves_the_loss(report):
    _, _, data = report
    losses = data["reference"]["consistent"]["loss"]
    assert losses[2] < losses[0]


def test_vanilla_differs_wherever_a_sum_is_split(tmp_path_factory):
    _, _, data = _report("bf16", tmp_path_factory)
    vanilla = _rows(data, vanilla=True)
    assert sorted(vanilla) == sorted(RUNS["bf16"][0])
    for name in SPLIT_SUMS:
        steps = vanilla[name]["steps"]
        assert not all(s[k] for s in steps for k in VERDICTS), name
        assert any(s["grads_differ"] for s in steps), name


# ---- in-process: the exact norm and the refusals ----

def _exact(tensors):
    return float(sum(Fraction(float(v)) ** 2 for t in tensors for v in t.reshape(-1).tolist()))


@pytest.fixture(params=["host-loop", "torch-ops"])
def norm_path(request, monkeypatch):
    """Each exact-norm test on both accumulation paths on the host: the compiled C loop (this machine
    has a C compiler, as CI does: it must build) and the torch operations devices run."""
    from mindspeed_tp.kernels import host_square_sums

    if request.param == "host-loop":
        assert host_square_sums.library() is not None, "the exact norm's C loop did not build"
    else:
        monkeypatch.setattr(host_square_sums, "library", lambda: None)
    return request.param


def test_exact_grad_norm_is_order_independent_and_correctly_rounded(norm_path):
    from mindspeed_tp.numerics.bitwise_training.grad_norm import exact_sum_of_squares, exponent_sums

    gen = torch.Generator().manual_seed(0)
    random.seed(0)
    grads = [torch.randn(500, generator=gen) * 10 ** random.uniform(-20, 4) for _ in range(6)]
    total = exact_sum_of_squares(exponent_sums(grads))
    flat = torch.cat(grads)
    shuffled = flat[torch.randperm(flat.numel(), generator=gen)]
    parts = [exponent_sums([shuffled[:777]]), exponent_sums([shuffled[777:2000], shuffled[2000:]])]
    assert exact_sum_of_squares(parts[1] + parts[0]) == total  # any split, any order of the integer sums
    assert total == _exact(grads)


def test_exact_grad_norm_edge_values(norm_path):
    from mindspeed_tp.numerics.bitwise_training.grad_norm import exact_sum_of_squares, exponent_sums

    assert exact_sum_of_squares(exponent_sums([torch.zeros(4)])) == 0.0
    tiny = torch.tensor([1e-45, -3e-39, 3.0e38])  # subnormals and the largest exponents
    assert exact_sum_of_squares(exponent_sums([tiny])) == _exact([tiny])


def _negative_nan():
    """x86's 0/0 (and inf - inf, 0 * inf): a NaN with the sign bit set."""
    nan = torch.zeros(1) / torch.zeros(1)
    return nan if nan.view(torch.int32).item() < 0 else -torch.tensor([float("nan")])


@pytest.mark.parametrize("values", [
    [1.0, float("inf")], [float("-inf"), 2.0], ["-nan", 1.0], [float("nan"), float("inf")], ["-nan", float("-inf")],
])
def test_exact_grad_norm_propagates_non_finite_values_as_vector_norm_does(values, norm_path):
    from mindspeed_tp.numerics.bitwise_training.grad_norm import grad_norm

    assert _negative_nan().view(torch.int32).item() < 0
    grads = torch.cat([_negative_nan() if v == "-nan" else torch.tensor([v]) for v in values])
    expected = torch.linalg.vector_norm(grads.double()).item()
    got = grad_norm([grads, torch.ones(3)], None, "cpu")
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


def test_exact_grad_norm_accumulators_never_wrap():
    """An accumulator near 2^63 (beyond ~2^38 elements in one exponent bin, or the ranks' sum) is
    normalised exactly, by a fixed number of carries, instead of wrapping."""
    from mindspeed_tp.numerics.bitwise_training import grad_norm as gn

    acc = gn.exponent_sums([torch.tensor([3.0, 1e-3, 7e5, 3.0e38])])
    scale = (1 << 62) // int(acc.max())
    big = acc * scale  # as if ~2^38 times these elements had been accumulated
    expected = gn.exact_sum_of_squares(big)
    assert int(big.max()) >= 1 << 61
    gn.normalise(big)
    assert int(big[:, 1:gn._INF].max()) < 1 << 24 and int(big.min()) >= 0
    assert gn.exact_sum_of_squares(big) == expected
    ranks = big.clone()
    gn.normalise(ranks)  # what grad_norm does before an all-reduce, here over 2^20 ranks
    assert gn.exact_sum_of_squares(ranks * (1 << 20)) == expected * (1 << 20)  # their sum: no wrap, exact


def test_exact_grad_norm_normalises_while_it_accumulates(monkeypatch, norm_path):
    """Chunks of 3 elements, a normalisation every 2 chunks: the periodic carries keep the total exact."""
    from mindspeed_tp.numerics.bitwise_training import grad_norm as gn

    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(40, generator=gen) * 1e3, torch.randn(17, generator=gen).bfloat16()]
    expected = _exact([g.float() for g in grads])
    monkeypatch.setattr(gn, "_CHUNK", 3)
    monkeypatch.setattr(gn, "_CHUNKS_PER_NORMALISE", 2)
    assert gn.exact_sum_of_squares(gn.exponent_sums(grads)) == expected


def test_exact_grad_norm_host_loop_and_torch_ops_give_the_same_total(monkeypatch):
    """Values over the whole fp32 range (subnormals, the largest exponents, both signs), lengths not a
    multiple of the loop's 4 bin copies and beyond its 2^14-element blocks, fp32 and bf16: the C
    loop's total is the torch operations' and the exact one, and its accumulators stay in range."""
    from mindspeed_tp.kernels import host_square_sums
    from mindspeed_tp.numerics.bitwise_training import grad_norm as gn

    gen = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 0x7F800000, (40_003,), generator=gen, dtype=torch.int32)  # every finite |value|
    signs = torch.randint(0, 2, bits.shape, generator=gen, dtype=torch.int32) << 31
    spread = (bits | signs).view(torch.float32)
    grads = [spread, torch.randn(16_385, generator=gen).bfloat16(), torch.tensor([1e-45, -3e-39, 3.0e38]), spread[:7]]
    expected = _exact([g.float() for g in grads])
    host = gn.exponent_sums(grads)
    assert host_square_sums.library() is not None
    assert int(host[:, 1:gn._INF].max()) < 1 << 47 and int(host.min()) >= 0
    monkeypatch.setattr(host_square_sums, "library", lambda: None)
    ops = gn.exponent_sums(grads)
    assert gn.exact_sum_of_squares(host) == gn.exact_sum_of_squares(ops) == expected


@pytest.mark.parametrize("build", ["native", "avx2"])
def test_exact_grad_norm_windowed_blocks_give_the_histograms_total(build):
    """The C loop's windowed path (a block's values within 24 binades) against its
    histogram: gradient-like blocks with zeros of both signs and a tail off the vector width give
    other accumulators (the windowed path ran) and the same, exact total; a block reaching exactly
    its window's lowest binade (22 below its largest exponent) is windowed, one a binade lower (or
    holding a subnormal) falls back to the histogram (the same accumulators). ``native``: the build
    every run uses (a CPU with AVX2 must have the windowed path); ``avx2``: the AVX2 variant built
    for x86-64-v3, so a CPU with AVX-512 tests the code an AVX2-only CPU runs too."""
    from mindspeed_tp.kernels import host_square_sums as hs
    from mindspeed_tp.numerics.bitwise_training import grad_norm as gn

    from mindspeed_tp.devices.cpu_isa import cpu_flags

    flags = cpu_flags()
    vector_isa = "avx2" in flags
    if build == "native":
        lib = hs.library()
        assert lib is not None
    else:
        assert vector_isa, "this x86-64-v3 build needs a CPU with AVX2 (an x86 host)"
        lib = hs.load(hs._build(hs._compiler(), "-march=x86-64-v3"))
    assert lib.exact_square_sums_windowed() == int(vector_isa)

    def both(chunk):
        accs = []
        for histogram_only in (False, True):
            acc = torch.zeros(2, gn._BINS, dtype=torch.int64)
            hs.add_square_sums(lib, acc, chunk, gn._NAN, gn._INF, histogram_only=histogram_only)
            accs.append(acc)
        assert gn.exact_sum_of_squares(accs[0]) == gn.exact_sum_of_squares(accs[1]) == _exact([chunk])
        return accs

    gen = torch.Generator().manual_seed(9)
    block = hs.WINDOW_BLOCK
    grads = torch.randn(3 * block + 13, generator=gen) * 1e-3
    grads[::97] = 0.0
    grads[1::89] = -0.0
    windowed, histogram = both(grads)
    assert not torch.equal(windowed, histogram) or not vector_isa

    top = torch.full((block,), 1.5)  # exponent 127; the window is 128 - 23 .. 128
    top[1:] = torch.randn(block - 1, generator=gen).clamp(-1.9, 1.9)
    top[5] = 2.0 ** -22 * 1.75
    windowed, histogram = both(top)
    assert not torch.equal(windowed, histogram) or not vector_isa
    for below in (2.0 ** -23 * 1.75, 1e-40):  # one binade below the window; a subnormal
        top[5] = below
        windowed, histogram = both(top)
        assert torch.equal(windowed, histogram)


@pytest.mark.parametrize("microbatches,dp,groups", [(1, 1, 2), (3, 2, 2), (2, 4, 2), (4, 2, 1), (6, 1, 2)])
def test_refusals_microbatch_plan(microbatches, dp, groups):
    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.numerics.bitwise_training import accumulation

    with pytest.raises(ConfigError, match="microbatch_groups"):
        accumulation.set_schedule(microbatches, dp, 0, groups)


def test_microbatch_plan_accepted_and_groups_follow_the_sampler():
    from mindspeed_tp.numerics.bitwise_training import accumulation

    accumulation.set_schedule(4, 1, 0, 2)
    assert [accumulation._group(k) for k in range(4)] == [0, 1, 0, 1]
    accumulation.set_schedule(2, 2, 1, 2)
    assert [accumulation._group(k) for k in range(2)] == [1, 1]
    assert [accumulation._bit_reversed(g, 4) for g in range(4)] == [0, 2, 1, 3]


def test_refusals_models_the_mode_does_not_cover():
    from types import SimpleNamespace

    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.numerics.bitwise_training.patches import check_ddp

    class Model(torch.nn.Module):
        def __init__(self, **config):
            super().__init__()
            self.config = SimpleNamespace(**config)

    ddp = SimpleNamespace(num_distributed_optimizer_instances=1)
    with pytest.raises(ConfigError, match="num_distributed_optimizer_instances"):
        check_ddp(Model(), SimpleNamespace(num_distributed_optimizer_instances=2))
    check_ddp(Model(), ddp)  # a dense untied model passes
    # issue #55: megatron's default per-rank mean under CP makes the objective depend on the CP size
    with pytest.raises(ConfigError, match="context_parallel_size=2 and calculate_per_token_loss=False"):
        check_ddp(Model(context_parallel_size=2, calculate_per_token_loss=False), ddp)
    check_ddp(Model(context_parallel_size=2, calculate_per_token_loss=True), ddp)
    check_ddp(Model(context_parallel_size=1, calculate_per_token_loss=False), ddp)


def test_a_sync_run_by_the_tree_refuses_the_nan_check_and_keeps_shards_as_megatron_would():
    from types import SimpleNamespace

    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.numerics.bitwise_training.patches import _sharded_sync

    def group(nan=False, sharded=True):
        return SimpleNamespace(ddp_config=SimpleNamespace(check_for_nan_in_grad=nan, use_distributed_optimizer=sharded))

    with pytest.raises(ConfigError, match="check_for_nan_in_grad.*the expert gradients' tree reduction"):
        _sharded_sync(group(nan=True), (), {}, "the expert gradients' tree reduction")
    assert _sharded_sync(group(), (), {}, "x") is True
    assert _sharded_sync(group(), (), {"force_all_reduce": True}, "x") is False  # every rank keeps the whole
    assert _sharded_sync(group(), (True,), {}, "x") is False
    assert _sharded_sync(group(sharded=False), (), {}, "x") is False


def test_profile_field_validation():
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.errors import ConfigError

    base = load_profile("default")
    assert base.bitwise_training is False and base.microbatch_groups == 2
    for bad in (dict(microbatch_groups=3), dict(bitwise_training="yes")):
        with pytest.raises(ConfigError):
            base.replace(**bad)
    with pytest.raises(ConfigError, match="canonical_tree"):
        load_profile("rollout-tp1").replace(bitwise_training=True)


RESHARD = ["--model", "tiny-dense", "--dtype", "bf16", "--global-batch-size", "4", "--micro-batch-size", "1",
           "--seq-length", "32", "--bitwise-training"]


@pytest.fixture(scope="module")
def four_steps_on_one_device(tmp_path_factory):
    """The uninterrupted trajectory: 4 steps on one device, its final state (layout-free)."""
    from safetensors.torch import load_file

    path = str(tmp_path_factory.mktemp("straight") / "straight.safetensors")
    proc = run_cli("train-check", *RESHARD, "--layouts", "tp1", "--steps", "4", "--save-state", path)
    assert proc.returncode == 0, explain(proc)
    return load_file(path)


def _same_state(path, straight):
    from safetensors.torch import load_file

    state = load_file(path)
    assert sorted(state) == sorted(straight) and any(k.startswith("exp_avg_sq/") for k in state)
    return [k for k in state if not bits_equal(state[k], straight[k])]


def test_a_killed_rank_ends_the_run_and_it_resumes_on_another_layout_with_the_same_bits(tmp_path,
                                                                                         four_steps_on_one_device):
    """4 steps at tp2-sp-pp2 checkpointed after every step; rank 1 is SIGKILLed after step 2: the
    run ends with exit 3 naming it, the checkpoints of steps 1 and 2 are complete; resumed at
    tp1-dp2 (--steps stays 4), the final state is bitwise the uninterrupted one-device run's.
    That is also resharding mid-run: the checkpoint is --save-state's layout-free file, which the
    resume loads (as --load-state does) into another layout."""
    import re

    from safetensors import safe_open
    from safetensors.torch import load_file

    from conftest import FAULT_ENV

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    killed = run_cli("train-check", *RESHARD, "--layouts", "tp2-sp-pp2", "--steps", "4", "--checkpoint-dir", str(ckpt),
                     "--timeout", "60", env={FAULT_ENV: "kill@after-step-2:1"})
    assert killed.returncode == 3, explain(killed)
    named = re.search(r"local rank\(s\) \[([\d, ]+)\] of the 4-process world exited without a report", killed.stderr)
    assert named and 1 in [int(r) for r in named.group(1).split(",")], explain(killed)
    assert sorted(os.listdir(ckpt)) == ["step-000001.safetensors", "step-000002.safetensors"]
    resumed = str(tmp_path / "resumed.safetensors")
    proc = run_cli("train-check", *RESHARD, "--layouts", "tp1-dp2", "--steps", "4", "--resume", str(ckpt),
                   "--checkpoint-dir", str(ckpt), "--save-state", resumed)
    assert proc.returncode == 0, explain(proc)
    assert _same_state(resumed, four_steps_on_one_device) == []
    with safe_open(resumed, framework="pt") as f:
        assert f.metadata()["steps"] == "4"
    assert sorted(os.listdir(ckpt)) == ["step-000003.safetensors", "step-000004.safetensors"]  # the last two
    third = load_file(str(ckpt / "step-000003.safetensors"))
    assert not bits_equal(third["param/output_layer.weight"],
                          four_steps_on_one_device["param/output_layer.weight"])  # it trained on after step 3


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_checkpoint_is_refused_by_name_and_left_alone(tmp_path, damage):
    from mindspeed_tp.check.train.state_file import checkpoint_path, write_atomically

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    for step in (1, 2):
        write_atomically(checkpoint_path(str(ckpt), step), {"param/w": torch.arange(64.0) * step}, {"steps": str(step)})
    newest = checkpoint_path(str(ckpt), 2)
    blob = open(newest, "rb").read()
    damaged = blob[: len(blob) - 40] if damage == "truncated" else blob[:-8] + bytes(b ^ 0xFF for b in blob[-8:])
    with open(newest, "wb") as f:
        f.write(damaged)
    before = {n: open(ckpt / n, "rb").read() for n in os.listdir(ckpt)}
    proc = run_cli("train-check", *RESHARD, "--layouts", "tp1-dp2", "--steps", "4", "--resume", str(ckpt))
    assert proc.returncode == 2, explain(proc)
    assert newest in proc.stderr and ("corrupted" in proc.stderr or "unreadable" in proc.stderr)
    assert {n: open(ckpt / n, "rb").read() for n in os.listdir(ckpt)} == before


def test_dyadic_blocks_partition_a_range_into_subtrees():
    from mindspeed_tp.contract.tree import dyadic_blocks

    assert dyadic_blocks(0, 12) == [(0, 8), (8, 4)]
    assert dyadic_blocks(3, 6) == [(3, 1), (4, 2)]
    assert dyadic_blocks(6, 9) == [(6, 2), (8, 1)]
    for start, stop in [(0, 1), (5, 37), (9536, 19072)]:
        blocks = dyadic_blocks(start, stop)
        assert sum(size for _, size in blocks) == stop - start
        assert all(s % size == 0 for s, size in blocks)  # aligned: each block is a subtree


DP4_LAYOUTS = ["tp1-dp4", "tp1-dp2", "tp2-sp-dp2", "tp1-pp2-dp4"]


@full_tier(covered_by="tests/test_bitwise_training.py::"
                      "test_tied_embeddings_and_a_non_power_of_two_run_of_vocab_leaves_every_step_bitwise",
           why="DP 4 with microbatch_groups 4 (the DP levels folded by moving bucket slices) runs in the "
               "tied-embedding launch (tp1-dp4, same profile, distributed optimizer)")
def test_four_dp_ranks_fold_the_tree_by_moving_data(tmp_path):
    """microbatch_groups: 4 and DP=4: the DP levels are folded by an all-to-all of bucket slices and
    local adds (ranks in the tree's order), not by the collective's sum; DP=2 then folds two groups
    per rank locally first. Distributed optimizer and overlapped reduction on: with a pipeline the
    first step's sync is started twice (the backward hook, then the schedule), and runs once."""
    profile = tmp_path / "g4.yaml"
    profile.write_text("name: bitwise-g4\nbitwise_training: true\nmicrobatch_groups: 4\n")
    _assert_every_step_bitwise(_bitwise_run(tmp_path, "tiny-dense", DP4_LAYOUTS, "--profile", str(profile),
                                            "--distributed-optimizer", "--overlap", global_batch="8"))


TIED_LAYOUTS = tiered("test_bitwise_training.py: tied-embedding launch's layouts",
                      ["tp2-sp", "tp1-dp4", "tp1-pp2"],
                      ["tp2-sp", "tp4-sp", "tp1-dp4", "tp1-cp2-dp2", "tp1-pp2", "tp2-sp-pp2-dp2"],
                      "the tied rows folded over DP 4, the tied weight across a pipeline, a vocab range off a "
                      "subtree's edge at TP 2 (6 leaves from leaf 6); TP 4, CP (whose rows the bf16 launch's CP "
                      "layouts fold) and the crossing of all four are the full cases")


def test_tied_embeddings_and_a_non_power_of_two_run_of_vocab_leaves_every_step_bitwise(tmp_path):
    """The input embedding and the LM head share one weight: on one stage its two gradients meet in
    one parameter, across a pipeline on two ranks; both are accumulated apart and added once. On one
    stage the embedding's are kept as rows of the step's token ids (by the micro-batch groups: 4, so
    one rank folds four, two ranks two each, four DP ranks one each, folded over DP by moving slices;
    under CP from the whole micro-batch, one CP copy each) and checked against a pipeline stage's
    dense embedding backward.
    The vocabulary leaves each rank a non-power-of-two number of vocab leaves, as a real one does
    (1100 padded to 1536: 12, 6 and 3 leaves of 128 rows at TP 1, 2, 4, ranges starting off a
    subtree's edge): the LM head's input gradient folds each rank's range as aligned blocks and
    merges all blocks in tree order -- the same bits."""
    model = tmp_path / "tied-v1100.yaml"
    model.write_text("name: tiny-dense-tied-v1100\nnum_layers: 2\nhidden_size: 128\nnum_attention_heads: 8\n"
                     "num_query_groups: 4\nkv_channels: 32\nffn_hidden_size: 256\nvocab_size: 1100\n"
                     "padded_vocab_size: 1536\nmax_position_embeddings: 512\nrotary_base: 1000000\n"
                     "norm_epsilon: 1.0e-6\nqk_layernorm: true\ntie_word_embeddings: true\n")
    profile = tmp_path / "g4.yaml"
    profile.write_text("name: bitwise-g4\nbitwise_training: true\nmicrobatch_groups: 4\n")
    _assert_every_step_bitwise(_bitwise_run(tmp_path, model, TIED_LAYOUTS, "--profile", str(profile),
                                            "--distributed-optimizer", steps="3", global_batch="8"))


@pytest.mark.version_lines
def test_bitwise_training_on_this_megatron_line(tmp_path, tmp_path_factory):
    """The DDP hook, bucket sync, finalize and clipping targets differ by name and signature across
    megatron-core lines (0.12's _allreduce_layernorm_grads, 0.16/0.19's tp_group argument): one small
    run per line, overlap and the distributed optimizer on, TP with SP and DP. With the whole matrix
    (the main line) the bf16 launch runs these layouts with these flags among others: its rows are
    checked, no launch of its own."""
    layouts, flags = ["tp2-sp", "tp1-dp2"], ["--distributed-optimizer", "--overlap"]
    if main_line():
        _, proc, data = _report("bf16", tmp_path_factory)
        assert proc.returncode == 0, explain(proc)
        assert set(layouts) <= set(RUNS["bf16"][0]) and set(flags) <= set(RUNS["bf16"][1])
        assert set(layouts) <= set(_rows(data, vanilla=False)) and data["all_bitwise_equal"] is True
    else:
        data = _bitwise_run(tmp_path, "tiny-dense", layouts, "--bitwise-training", *flags)
    _assert_every_step_bitwise(data)


# ---- in-process: the accumulation's state across steps ----

def _bitwise_strategy():
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.numerics.bitwise_training.strategy import BitwiseTraining

    return BitwiseTraining(load_profile("default").replace(bitwise_training=True))


def test_forward_only_passes_are_neither_planned_nor_reset(monkeypatch):
    """verl's compute_log_prob runs forward_only passes with its own (dynamic) micro-batch counts."""
    from mindspeed_tp import numerics
    from mindspeed_tp.numerics.bitwise_training import accumulation
    from mindspeed_tp.numerics.bitwise_training.patches import forward_backward_func

    monkeypatch.setattr(numerics.ACTIVE, "_strategy", _bitwise_strategy())
    accumulation.set_schedule(4, 1, 0, 2)
    plan = dict(accumulation._plan)
    weight = torch.nn.Parameter(torch.zeros(5, 3))
    accumulation.add_embedding_rows(weight, torch.tensor([1, 4]), torch.ones(2, 3))  # a tied embedding's rows
    ran = []
    schedule = forward_backward_func(lambda: lambda **kw: ran.append(kw) or "ran")()
    assert schedule(num_microbatches=3, forward_only=True) == "ran" and ran  # 3: refused for a training step
    assert accumulation._plan == plan
    assert accumulation._embedding_counts[weight] == 1 and list(accumulation._embedding_rows[weight]) == [0]
    accumulation.reset()


def _holder():
    p = torch.nn.Parameter(torch.zeros(4))
    p.main_grad = torch.zeros(4)
    setattr(p, "_mindspeed_tp_bitwise_hook", True)
    return p


def _step(holder, grads):
    from mindspeed_tp.numerics.bitwise_training import accumulation

    accumulation.reset()
    accumulation.set_schedule(len(grads), 1, 0, 2)
    for g in grads:
        if not accumulation.route_microbatch(holder, g):
            holder.main_grad.add_(g)
    accumulation.fold_groups([holder])
    return holder.main_grad.clone()


def test_two_groups_of_one_micro_batch_each_fold_in_main_grad_without_a_buffer():
    """Two micro-batches in two groups: the tree is one addition of their gradients, accumulated
    straight in main_grad (no fp32 group buffer: the bitwise step's memory at DP=1) with the bits the
    group path gives, (0 + m_a) + (0 + m_b), -0.0 included."""
    from mindspeed_tp.numerics.bitwise_training import accumulation

    m0 = torch.tensor([-0.0, 1e-8, 3.0, -0.0])
    m1 = torch.tensor([-0.0, 1.0, -3.0, 2.0])
    holder = _holder()
    got = _step(holder, [m0, m1])
    assert not getattr(holder, accumulation.BUFFERS_ATTR, None)
    expected = (torch.zeros(4) + m0) + (torch.zeros(4) + m1)
    assert bits_equal(got.view(torch.int32), expected.view(torch.int32))
    assert got[0].item() == 0.0 and not torch.signbit(got[0])
    four = _holder()
    _step(four, [m0, m1, m0, m1])  # two micro-batches per group: the second group's chain needs its buffer
    assert getattr(four, accumulation.BUFFERS_ATTR)


@pytest.mark.parametrize("by_index", [False, True], ids=["f_embedding", "indexing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_embeddings_gradient_by_its_distinct_rows_is_the_dense_backwards(by_index, dtype):
    """The embedding's weight gradient computed on a weight of the distinct ids only (how a tied
    weight's rows are kept, and under CP): hundreds of tokens per id, so the order of a row's
    additions shows in the bits, more than 1000 tokens (the kernel's parallel path), a row whose only
    gradient is -0.0 -- every row the dense backward's bits (``F.embedding`` and megatron's
    deterministic ``weight[ids]``), the rows no id names +0.0 there."""
    from mindspeed_tp.numerics.bitwise_training.embedding import _lookup, distinct_rows_grad

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 6, (3, 400), generator=gen)
    ids[0, :5] = 9
    grad = (torch.randn(3, 400, 16, generator=gen) * 1e3).to(dtype)
    ids[1, 7], grad[1, 7] = 11, -0.0
    weight = torch.zeros(14, 16, dtype=dtype, requires_grad=True)
    (dense,) = torch.autograd.grad(_lookup(ids, weight, by_index), [weight], grad)
    rows, dw = distinct_rows_grad(ids, grad, dtype, by_index)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 9, 11]
    assert bits_equal(dw, dense[rows])
    assert bits_equal(dense[[6, 7, 8, 10, 12, 13]], torch.zeros(6, 16, dtype=dtype))


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo world of this process alone for the test, destroyed after it (later tests in this process
    see torch.distributed uninitialised, as they expect)."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "a test left torch.distributed initialised"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_tied_embedding_rows_add_to_the_lm_heads_gradient_as_the_dense_chains_do(world_of_one):
    """A tied weight on one stage: the embedding's rows by micro-batch group (4 micro-batches, 2
    groups), folded, scaled as the bucket is and added to the LM head's reduced gradient give the
    dense path's bits -- each group's main_grad chain of dense gradients, the groups' one addition,
    scaled, + the LM head's -- -0.0 included (a row of the LM head's -0.0 that no id names becomes
    +0.0, as + the embedding's +0.0 makes it). A step whose embedding gradient bypassed the rows is
    refused."""
    from types import SimpleNamespace

    from mindspeed_tp.models.marks import TIED_HEAD_ATTR
    from mindspeed_tp.numerics.bitwise_training import accumulation
    from mindspeed_tp.numerics.bitwise_training.embedding import distinct_rows_grad

    gen = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.zeros(10, 4, dtype=torch.bfloat16))
    setattr(weight, TIED_HEAD_ATTR, True)
    head = torch.randn(10, 4, generator=gen)
    head[3], head[5, 0] = -0.0, -0.0
    weight.main_grad = head.clone()
    bucket = SimpleNamespace(gradient_scaling_factor=0.5)
    ddp = SimpleNamespace(use_distributed_optimizer=False, average_in_collective=False)
    group = SimpleNamespace(ddp_config=ddp, data_parallel_group=world_of_one, param_to_bucket={weight: bucket})
    model = [SimpleNamespace(param_to_bucket_group={weight: group})]

    accumulation.reset()
    accumulation.set_schedule(4, 1, 0, 2)
    chains = {}
    for k in range(4):
        ids = torch.randint(0, 10, (2, 300), generator=gen)
        ids[ids == 3] = 4  # row 3: no id
        grad = torch.randn(2, 300, 4, generator=gen).to(torch.bfloat16)
        grad[0, :3] = -0.0
        rows, dw = distinct_rows_grad(ids, grad, torch.bfloat16, False)
        accumulation.add_embedding_rows(weight, rows, dw)
        g = accumulation._group(k)
        chains[g] = chains.get(g, torch.zeros(10, 4)).add_(torch.zeros(10, 4, dtype=torch.bfloat16).index_copy_(0, rows, dw))
    expected = (chains[0] + chains[1]) * 0.5 + head
    accumulation.add_tied_embeddings(model)
    assert bits_equal(weight.main_grad.view(torch.int32), expected.view(torch.int32))
    assert not torch.signbit(weight.main_grad[3]).any() and torch.signbit(head[3]).all()

    accumulation.reset()
    accumulation.set_schedule(4, 1, 0, 2)
    with pytest.raises(RuntimeError, match="did not come through its lookup"):
        accumulation.add_tied_embeddings(model)
    accumulation.reset()


def test_a_step_aborted_after_some_micro_batches_leaves_nothing_for_the_next():
    from mindspeed_tp.numerics.bitwise_training import accumulation

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4, generator=gen) for _ in range(4)]
    fresh = _step(_holder(), grads)
    holder = _holder()
    accumulation.reset()
    accumulation.set_schedule(4, 1, 0, 2)
    assert accumulation.route_microbatch(holder, torch.full((4,), 1e3))  # micro-batch 0: a group buffer
    # ... the step raises here (OOM recovery, a fault-tolerant loop); megatron zeroes main_grad
    holder.main_grad.zero_()
    assert bits_equal(_step(holder, grads).view(torch.int32), fresh.view(torch.int32))


def test_a_freed_holder_leaves_no_count_behind():
    """Counts are kept per holder object (weakly), not per id(): a new parameter at a freed one's
    address must start at micro-batch 0."""
    import gc

    from mindspeed_tp.numerics.bitwise_training import accumulation

    accumulation.reset()
    accumulation.set_schedule(4, 1, 0, 2)
    holder = _holder()
    accumulation.route_microbatch(holder, torch.ones(4))
    assert len(accumulation._counts) == 1
    del holder
    gc.collect()
    assert len(accumulation._counts) == 0
    accumulation.reset()


@pytest.mark.parametrize("backend,device", [("triton", "cpu"), ("npu", "cpu"), ("auto", "cuda"), ("auto", "npu"),
                                            ("torch", "npu"), ("torch", "cuda")])
def test_bitwise_training_is_refused_off_the_torch_backend(monkeypatch, backend, device):
    """Not verified on a GPU or NPU (attention's batched GEMMs, the embedding's dense backward)."""
    import mindspeed_tp
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.numerics.bitwise_training import strategy as bitwise_training

    monkeypatch.setattr(bitwise_training, "machine_device_type", lambda: device)
    profile = load_profile("default").replace(bitwise_training=True, backend=backend)
    runs = {"cuda": "triton", "npu": "npu"}[device] if backend == "auto" else backend
    with pytest.raises(ConfigError, match=f"runs the {runs} backend on this {device} machine"):
        mindspeed_tp.enable(profile)
    for accepted in ("auto", "torch"):  # the CPU host: the torch backend
        monkeypatch.setattr(bitwise_training, "machine_device_type", lambda: "cpu")
        bitwise_training.BitwiseTraining(profile.replace(backend=accepted)).check_ready()


def _finalize_module(monkeypatch, name, source):
    """A stand-in megatron finalize module made from ``source``, importable as ``name``."""
    import sys
    import types

    module = types.ModuleType(name)
    exec(source, module.__dict__)
    monkeypatch.setitem(sys.modules, name, module)
    module.reduce.__module__ = name
    return module


_FUTURE_FINALIZE = '''
import torch
from torch._utils import _flatten_dense_tensors


def reduce(model, config, tp_group=None):
    """A megatron-core line that also TP-reduces a new category of parameters."""
    grads = [p.main_grad.data for chunk in model for p in chunk.parameters()
             if getattr(p, "new_category", False) or getattr(p, "sequence_parallel", False)]
    if grads:
        torch.distributed.all_reduce(_flatten_dense_tensors(grads), group=tp_group)
'''


def test_a_tp_reduced_gradient_of_a_category_megatron_adds_is_refused_not_skipped(monkeypatch):
    """Megatron's own function decides which gradients it reduces across TP (dry-run): the norms'
    (folded in the backward) pass, any other is refused by name."""
    from mindspeed_tp import numerics
    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.models.marks import mark_per_token_params
    from mindspeed_tp.numerics.bitwise_training.patches import tp_norm_allreduce

    future = _finalize_module(monkeypatch, "future_finalize", _FUTURE_FINALIZE)
    monkeypatch.setattr(numerics.ACTIVE, "_strategy", _bitwise_strategy())
    model = torch.nn.Module()
    model.norm = torch.nn.LayerNorm(4)
    model.proj = torch.nn.Linear(4, 4, bias=False)
    mark_per_token_params(model.norm)
    for p in model.parameters():
        p.main_grad = torch.full_like(p, 3.0)
        p.sequence_parallel = p in set(model.norm.parameters())
    wrapped = tp_norm_allreduce(future.reduce)
    wrapped([model], None)  # only the norms: already folded, nothing reduced
    assert all(bits_equal(p.main_grad, torch.full_like(p, 3.0)) for p in model.parameters())
    model.proj.weight.new_category = True
    with pytest.raises(ConfigError, match="parameter proj.weight asks for a TP all-reduce"):
        wrapped([model], None)


_OTHER_API_FINALIZE = '''
def _group_allreduce(tensor):
    """Stands in for a process group's own allreduce (or a coalescing manager): the sum over TP=2 ranks
    holding the same norm gradient, reached without torch.distributed.all_reduce."""
    tensor.mul_(2)


def reduce(model, config, tp_group=None):
    for chunk in model:
        for p in chunk.parameters():
            if getattr(p, "sequence_parallel", False):
                _group_allreduce(p.main_grad)
'''


def test_a_tp_reduction_through_another_collective_api_is_refused_not_passed(monkeypatch):
    """Issue #43, item 7: the dry run stubs torch.distributed.all_reduce only; a megatron line reducing
    through another API ran the real collective (norm gradients summed TP times) and the check passed."""
    from mindspeed_tp import numerics
    from mindspeed_tp.errors import ConfigError
    from mindspeed_tp.models.marks import mark_per_token_params
    from mindspeed_tp.numerics.bitwise_training.patches import tp_norm_allreduce

    other = _finalize_module(monkeypatch, "other_api_finalize", _OTHER_API_FINALIZE)
    monkeypatch.setattr(numerics.ACTIVE, "_strategy", _bitwise_strategy())
    model = torch.nn.Module()
    model.norm = torch.nn.LayerNorm(4)
    mark_per_token_params(model.norm)
    for p in model.parameters():
        p.main_grad = torch.full_like(p, 3.0)
        p.sequence_parallel = True
    with pytest.raises(ConfigError, match="norm.weight.main_grad .*other than torch.distributed.all_reduce"):
        tp_norm_allreduce(other.reduce)([model], None)


def test_the_dry_runs_gradient_digest_is_the_whole_tensors_sums_in_chunks():
    """The digest the dry run compares (``patches._bit_sums``) is computed a chunk at a time (no
    int64 copy of a whole LM-head gradient): the same integer sums as over the whole tensor at once,
    the squares' sum wrapping alike, and a write past the first chunk shows."""
    from mindspeed_tp.numerics.bitwise_training import patches

    g = torch.Generator().manual_seed(0)
    big = torch.randn(patches._BITS_CHUNK * 2 + 7, generator=g) * 1e30  # bit patterns near 2^31: squares wrap
    for t in (big, torch.randn(300, 700, generator=g).bfloat16(), torch.randn(5, generator=g), torch.empty(0)):
        bits = t.contiguous().view(-1).view(patches._INT_OF[t.element_size()]).long()
        assert patches._bit_sums(t) == (int(bits.sum()), int((bits * bits).sum()))
    before = patches._bit_sums(big)
    big[-1] = -big[-1]
    assert patches._bit_sums(big) != before


def test_a_subtree_missing_its_sibling_is_added_to_the_zero_subtree():
    """The trees over a non-power-of-two number of leaves (the LM head's vocab leaves per shard, a
    rank's blocks) are the perfect tree with zero leaves appended: a node whose sibling is empty gets
    +0.0 added, as the padded tree adds its zero leaves (so -0.0 becomes +0.0 there too)."""
    from mindspeed_tp.contract.tree import dyadic_blocks, fold_in_order, merge_blocks, tree_fold

    negative_zero = torch.full((3, 5), -0.0)
    padded_tree = tree_fold(torch.stack([negative_zero] * 6 + [torch.zeros(3, 5)] * 2), dim=0)
    in_order = fold_in_order([negative_zero.clone() for _ in range(6)], 8)
    blocks = {b: tree_fold(torch.stack([negative_zero] * b[1]), dim=0) for b in dyadic_blocks(0, 6)}
    for got in (in_order, merge_blocks(blocks)):
        assert bits_equal(got, padded_tree) and not bits_equal(got, negative_zero)
