"""Context parallelism (cpN layouts): Megatron's 2*CP chunk layout, the K/V all-gather in sequence
order, and the consistent attention of each rank's chunks -- logprobs bitwise equal to one device.

In-process: the layout against megatron-core's own get_batch_on_this_cp_rank, the exchange's
permutation, and the attention of every rank's query chunks over the gathered keys against the
one-device attention (bits, fp32 and bf16, padded and packed). Launched: one checker run per
(model, dtype, padded|packed) over several CP layouts, one train-check run (default mode: the
step-1 loss and in-step logprobs bitwise) and one with bitwise training (every step's loss, gradients,
parameters and optimizer state bitwise; packed CP batches refused by name there)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import bits_equal, explain, full_tier, run_cli, run_python, tiered
from test_bitwise_training import BITWISE_CP, _report as bitwise_report

from mindspeed_tp.kernels import consistent_attention, packed_attention
from mindspeed_tp.kernels import context_parallel as cp


def test_local_chunks_are_megatrons_get_batch_on_this_cp_rank():
    """megatron-core's own slicing (a world of one; its CP group is a stand-in object with size()
    and rank(), all get_batch_on_this_cp_rank reads of it) gives the columns local_positions names."""
    code = """
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core.utils import get_batch_on_this_cp_rank
from mindspeed_tp.kernels.context_parallel import local_positions
class Group:  # what get_pg_size / get_pg_rank read
    def __init__(self, size, rank): self._s, self._r = size, rank
    def size(self): return self._s
    def rank(self): return self._r
for size in (2, 4):
    for rank in range(size):
        tokens = torch.arange(48).view(1, 48)
        got = get_batch_on_this_cp_rank({"tokens": tokens.clone()}, cp_group=Group(size, rank))["tokens"]
        assert torch.equal(got[0], local_positions(48, size, rank)), (size, rank)
print("ok")
"""
    proc = run_python(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, explain(proc)


@pytest.mark.parametrize("bounds", [[0, 48], [0, 8, 24, 56]])
def test_gathered_rows_are_put_back_in_sequence_order(bounds):
    size = 2
    locals_ = [cp.packed_local_index(bounds, size, r) for r in range(size)]
    assert sorted(torch.cat(locals_).tolist()) == list(range(bounds[-1]))  # every column held once
    concat = torch.cat(locals_)  # what the all-gather delivers: rank 0's rows, then rank 1's
    assert torch.equal(concat[cp.sequence_order(bounds, size)], torch.arange(bounds[-1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [2, 4])
def test_each_ranks_chunks_over_gathered_keys_equal_one_device_bits(dtype, size):
    """Blocks of 16 keys, chunks of 200/(2*CP) tokens (not block-aligned), GQA: every rank's query
    rows at their absolute positions give the one-device rows bit for bit."""
    gen = torch.Generator().manual_seed(0)
    s, d = 200, 16
    q = torch.randn(2, 4, s, d, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, s, d, generator=gen).to(dtype) for _ in range(2))
    whole = consistent_attention(q, k, v, 0.25, block_size=16)
    for rank in range(size):
        pos = cp.local_positions(s, size, rank)
        mine = cp.cp_attention(q[:, :, pos], k, v, 0.25, True, pos, None, 16, 16, None)
        assert bits_equal(mine, whole[:, :, pos]), rank


def test_key_value_gradients_summed_over_the_cp_ranks_are_one_devices():
    """Default mode's backward: each rank's queries give dK/dV for every key; summed over the ranks
    (what the exchange's backward all-reduce does) they are one device's gradients, dQ each rank's
    rows of it (fp32, within round-off: only the forward is under the contract)."""
    gen = torch.Generator().manual_seed(2)
    s, d, size = 96, 16, 2
    q = torch.randn(1, 4, s, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, s, d, generator=gen, requires_grad=True) for _ in range(2))
    g = torch.randn(1, 4, s, d, generator=gen)
    whole = torch.autograd.grad(consistent_attention(q, k, v, 0.25, block_size=16), (q, k, v), g)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(size):
        pos = cp.local_positions(s, size, rank)
        mine = cp.cp_attention(q[:, :, pos], k, v, 0.25, True, pos, None, 16, 16, None)
        gq, gk, gv = torch.autograd.grad(mine, (q, k, v), g[:, :, pos])
        dq, dk, dv = dq + gq, dk + gk, dv + gv
    for ours, ref in zip((dq, dk, dv), whole):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        assert ref.abs().max() > 0


def test_packed_chunks_over_gathered_keys_equal_one_device_bits():
    gen = torch.Generator().manual_seed(1)
    bounds, size = [0, 8, 48, 112], 2
    q = torch.randn(112, 4, 16, generator=gen)
    k, v = (torch.randn(112, 2, 16, generator=gen) for _ in range(2))
    whole = packed_attention(q, k, v, bounds, 0.25, block_size=16)
    for rank in range(size):
        cols = cp.packed_local_index(bounds, size, rank)
        mine = cp.packed_cp_attention(q[cols], k, v, bounds, size, rank, 0.25, True, 16, 16, None)
        assert bits_equal(mine, whole[cols]), rank


def test_sequences_not_divisible_by_2cp_are_refused_by_name():
    from megatron.core.packed_seq_params import PackedSeqParams

    from mindspeed_tp import ConfigError
    from mindspeed_tp.contract.profile import load_profile
    from mindspeed_tp.models.layout import Layout, validate_layout
    from mindspeed_tp.models.spec import load_model_spec
    from mindspeed_tp.patches.attention import packed_boundaries

    spec, prof = load_model_spec("tiny-dense"), load_profile("default")
    validate_layout(Layout.parse("tp2-sp-cp2"), spec, prof, 136)
    with pytest.raises(ConfigError, match="--seq-length=138 is not divisible by 2\\*cp"):
        validate_layout(Layout.parse("cp2"), spec, prof, 138)
    with pytest.raises(ConfigError, match="--seq-length=140 is not divisible by 2\\*cp\\*tp=8"):
        validate_layout(Layout.parse("tp2-sp-cp2"), spec, prof, 140)
    cu = torch.tensor([0, 8, 14], dtype=torch.int32)
    with pytest.raises(ConfigError, match="a sequence of 6 tokens under context_parallel_size=2"):
        packed_boundaries(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu), 7, cp_size=2)


def test_layout_names_and_worlds():
    from mindspeed_tp.models.layout import Layout

    assert Layout.parse("cp2-pp2").name == "tp1-cp2-pp2"
    assert Layout.parse("tp2-sp-ep2-cp2") == Layout(tp=2, sp=True, ep=2, cp=2)
    assert Layout.parse("cp2-dp2").world_size == 4 and Layout.parse("tp2-cp2-pp2").required_world_size == 8
    assert Layout.parse("tp2-sp-cp2").without_cp().name == "tp2-sp"


def test_bitwise_training_with_cp_is_planned_and_packed_cp_is_refused_by_name():
    from mindspeed_tp import ConfigError, load_profile
    from mindspeed_tp.check.train.main import plan, resolve_args
    from mindspeed_tp.numerics.bitwise_training.strategy import BitwiseTraining

    assert [l.cp for l in plan(resolve_args(["--bitwise-training", "--layouts", "tp2-sp-cp2"])).layouts] == [2]
    strategy = BitwiseTraining(load_profile("default"))
    strategy.check_context_parallel(packed=False)  # padded (bshd): covered
    with pytest.raises(ConfigError, match="bitwise_training with context_parallel_size > 1 on packed"):
        strategy.check_context_parallel(packed=True)


# (model, dtype, packed) -> layouts of one checker launch (world 4). Padded and packed batches on the
# dense model (attention is where they differ), MoE with CP packed (its experts see the same rows).
ALL_CHECKS = {
    ("tiny-dense", "bf16", False): ["cp2", "cp4", "tp2-sp-cp2", "tp1-cp2-pp2"],
    ("tiny-dense", "fp32", True): ["cp2", "tp2-sp-cp2", "tp1-cp2-pp2"],
    ("tiny-moe", "bf16", True): ["tp1-ep2-cp2", "tp2-sp-ep2-cp2"],
}
CHECKS = {key: ALL_CHECKS[key] for key in tiered(
    "test_context_parallel.py: (model, dtype, packed) checker launches",
    [("tiny-dense", "bf16", False), ("tiny-moe", "bf16", True)], list(ALL_CHECKS),
    "padded CP (CP 2 and 4, with TP+SP, with PP) and packed CP (with EP, with TP+SP and EP): the chunking "
    "of packed sequences is the model's attention input, the same for the dense model; fp32 changes the "
    "kernels, not the chunks")}
_launched = {}


def launch(key, tmp_path_factory):
    if key not in _launched:
        model, dtype, packed = key
        tmp = tmp_path_factory.mktemp(f"cp-{model}-{dtype}-{packed}")
        flags = ["--packed"] if packed else ["--compare-vanilla"]
        proc = run_cli("check", "--model", model, "--dtype", dtype, "--layouts", ",".join(CHECKS[key]),
                       "--batch-size", "3", "--seq-length", "144", "--dump-logprobs", str(tmp),
                       "--json", str(tmp / "report.json"), *flags)
        assert proc.returncode == 0, explain(proc)
        _launched[key] = load_file(str(tmp / "logprobs.safetensors")), json.loads((tmp / "report.json").read_text())
    return _launched[key]


@pytest.mark.parametrize("key", list(CHECKS), ids=lambda k: f"{k[0]}-{k[1]}-{'packed' if k[2] else 'padded'}")
def test_cp_layouts_logprobs_bitwise_equal_to_one_device(key, tmp_path_factory):
    from mindspeed_tp.models.layout import Layout

    t, report = launch(key, tmp_path_factory)
    scored = t["scored"]
    ref = t["consistent/reference"]
    tokens = scored.t().reshape(-1)  # Megatron's token order (position-major) for the routing maps
    for layout in CHECKS[key]:
        name = Layout.parse(layout).name
        assert bits_equal(t[f"consistent/{name}"][scored], ref[scored]), (key, name)
        if key[0] == "tiny-moe":
            routing = t[f"consistent/routing/{name}"][:, tokens]
            assert routing.sum() > 0 and bits_equal(routing, t["consistent/routing/reference"][:, tokens]), (key, name)
    ours = [r for r in report["results"] if not r["vanilla"]]
    assert len(ours) == len(CHECKS[key]) and all(r["bitwise_equal_fraction"] == 1.0 for r in ours)
    assert all(r["layout"]["cp"] > 1 for r in ours)


def test_vanilla_is_compared_without_cp_and_the_report_says_so(tmp_path_factory):
    _, report = launch(("tiny-dense", "bf16", False), tmp_path_factory)
    vanilla = [r for r in report["results"] if r["vanilla"]]
    assert {r["ran_as"] for r in vanilla} == {"tp1", "tp2-sp", "tp1-pp2"}
    assert all("Transformer Engine" in r["note"] for r in vanilla)
    # vanilla's own TP split changes its bits (the point of the comparison)
    assert all(r["bitwise_equal_fraction"] < 1.0 for r in vanilla if r["ran_as"] == "tp2-sp")


@full_tier(covered_by="tests/test_context_parallel.py::test_bitwise_training_at_cp_every_step_bitwise",
           why="the same CP layouts through megatron's schedule, DDP over DP x CP and Adam; the bitwise-training "
               "launch checks step 1's loss and in-step logprobs there and every later step too")
def test_train_check_step_one_loss_bitwise_at_cp(tmp_path):
    """Default mode: megatron's own schedule, DDP over DP x CP and Adam; the step-1 loss and the
    in-step logprobs bitwise equal to one device (later steps: the plain backward, within round-off)."""
    out = tmp_path / "train.json"
    proc = run_cli("train-check", "--model", "tiny-dense", "--layouts", "tp2-sp-cp2,cp2-dp2,tp1-cp2-pp2",
                   "--steps", "2", "--json", str(out))
    assert proc.returncode == 0, explain(proc)
    rows = json.loads(out.read_text())["results"]
    assert sorted(r["layout"]["name"] for r in rows) == ["tp1-cp2-dp2", "tp1-cp2-pp2", "tp2-sp-cp2"]
    for r in rows:
        first = r["steps"][0]
        assert first["loss_bitwise_equal"] and first["logprobs_bitwise_equal"], r["layout"]


BITWISE_VERDICTS = ("loss_bitwise_equal", "grads_bitwise_equal", "params_bitwise_equal",
                    "optimizer_state_bitwise_equal", "grad_norm_bitwise_equal")


@pytest.fixture(scope="module")
def bitwise_cp(tmp_path_factory):
    """Bitwise training at CP: the rows of tests/test_bitwise_training.py's bf16 launch (3 steps, the
    distributed optimizer, overlapped reductions, full recompute, vanilla alongside) at BITWISE_CP."""
    _, proc, data = bitwise_report("bf16", tmp_path_factory)
    assert proc.returncode == 0, explain(proc)
    return data


def test_bitwise_training_at_cp_every_step_bitwise(bitwise_cp):
    assert bitwise_cp["bitwise_training"] is True and bitwise_cp["all_bitwise_equal"] is True
    ours = {r["layout"]["name"]: r for r in bitwise_cp["results"] if not r["vanilla"] and r["layout"].get("cp", 1) > 1}
    assert sorted(ours) == sorted(BITWISE_CP)
    for name, row in ours.items():
        assert [s["step"] for s in row["steps"]] == [1, 2, 3]
        assert row["steps"][0]["logprobs_bitwise_equal"], name
        for s in row["steps"]:
            bad = [k for k in BITWISE_VERDICTS if not s[k]]
            assert not bad, (name, s["step"], bad, s["grads_differ"][:3], s["optimizer_state_differ"][:3])
            assert s["grads_differ"] == [] and s["params_differ"] == [] and s["optimizer_state_differ"] == []
            assert s["grad_max_abs_diff"] == 0.0 and s["param_max_abs_diff"] == 0.0
            assert s["optimizer_state_max_abs_diff"] == 0.0
    losses = bitwise_cp["reference"]["consistent"]["loss"]
    assert losses[2] < losses[0]  # it trains


def test_vanilla_is_not_bitwise_where_cp_splits_the_sums(bitwise_cp):
    """Vanilla cannot run CP without Transformer Engine: it trains the same world with the CP ranks as
    DP ranks (the report says so), and its gradients differ from one device's there."""
    vanilla = {r["layout"]["name"]: r for r in bitwise_cp["results"] if r["vanilla"] and r["layout"].get("cp", 1) > 1}
    assert sorted(vanilla) == sorted(BITWISE_CP)
    assert {r["ran_as"] for r in vanilla.values()} == {"tp2-sp-dp2", "tp1-dp4", "tp1-pp2-dp2"}
    assert all("Transformer Engine" in r["note"] for r in vanilla.values())
    for name, row in vanilla.items():
        assert any(s["grads_differ"] for s in row["steps"]), name
        assert not all(s[k] for s in row["steps"] for k in BITWISE_VERDICTS), name


@pytest.mark.version_lines
def test_bitwise_training_under_cp_is_bitwise_or_refused_by_name_on_each_line():
    """megatron-core 0.12's gradients under CP are not the one-device ones in bitwise training (measured:
    every gradient differs, loss and logprobs equal): refused by name there; 0.16 and later train bitwise."""
    from mindspeed_tp.compat import megatron_line

    proc = run_cli("train-check", "--layouts", "cp2", "--dtype", "fp32", "--bitwise-training", "--steps", "1",
                   "--global-batch-size", "4", "--micro-batch-size", "1", "--seq-length", "32", timeout=600)
    if megatron_line() < (0, 16):
        assert proc.returncode == 2 and "context_parallel_size=2 on megatron-core" in proc.stderr, explain(proc)
    else:
        assert proc.returncode == 0 and "RESULT: bitwise equal to the one-device run" in proc.stdout, explain(proc)
