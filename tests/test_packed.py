"""Packed sequences (thd: one row, PackedSeqParams with cu_seqlens, as verl's use_remove_padding
scores them) through the patched attention, per-sequence RoPE and the logprob: bitwise equal to
the padded (bshd) single-device scoring of the same sequences, at tp1, tp2-sp, tp2-sp-pp2 (dense)
and tp2-sp-ep2 (MoE). The batch mixes lengths: one shorter than an attention block (12), ones
crossing one and two block boundaries (138, 264, 320), odd ones padded to the TP size (155, 119).
One checker launch per model; the tests assert on its dumped logprobs."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import bits_equal, explain, run_cli

CASES = {"tiny-dense": ["tp1", "tp2-sp", "tp2-sp-pp2"], "tiny-moe": ["tp2-sp-ep2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """model -> (dumped tensors, report) of one `check --packed` launch each."""
    out = {}
    for model, layouts in CASES.items():
        tmp = tmp_path_factory.mktemp(f"packed-{model}")
        proc = run_cli("check", "--packed", "--model", model, "--layouts", ",".join(layouts), "--batch-size", "6",
                       "--seq-length", "320", "--dump-logprobs", str(tmp), "--json", str(tmp / "report.json"))
        assert proc.returncode == 0, explain(proc)
        out[model] = load_file(str(tmp / "logprobs.safetensors")), json.loads((tmp / "report.json").read_text())
    return out


def test_batch_mixes_short_and_multi_block_sequences(runs):
    for t, _ in runs.values():
        lengths = (t["scored"].sum(dim=1) + 1).tolist()
        assert min(lengths) < 128 and max(lengths) > 2 * 128 and any(n % 2 for n in lengths)


def test_packed_logprobs_equal_padded_single_device(runs):
    for model, (t, report) in runs.items():
        scored = t["scored"]
        ref = t["consistent/reference"]
        for layout in CASES[model]:
            ours = t[f"consistent/{layout}"]
            assert bits_equal(ours[scored], ref[scored]), (model, layout)
            assert torch.isfinite(ours[scored]).all() and (ours[scored] < 0).all()
        assert len(report["results"]) == len(CASES[model])
        assert all(r["packed"] and r["bitwise_equal_fraction"] == 1.0 for r in report["results"])


def test_packed_moe_routing_equals_padded(runs):
    t, report = runs["tiny-moe"]
    b, s = t["scored"].shape
    scored = t["scored"].t().reshape(-1)  # Megatron's token order: position-major
    ref = t["consistent/routing/reference"][:, scored]
    assert ref.sum() > 0
    assert bits_equal(t["consistent/routing/tp2-sp-ep2"][:, scored], ref)
    assert report["results"][0]["routing_mismatch_fraction"] == 0.0


def test_unsupported_packing_is_refused_by_name():
    from megatron.core.packed_seq_params import PackedSeqParams

    from mindspeed_tp import ConfigError
    from mindspeed_tp.patches.attention import packed_boundaries

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    padded = torch.tensor([0, 6, 12], dtype=torch.int32)
    assert packed_boundaries(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu), 12) == [0, 5, 12]
    with pytest.raises(ConfigError, match="cu_seqlens_q_padded"):
        packed_boundaries(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                          cu_seqlens_q_padded=padded), 12)
    with pytest.raises(ConfigError, match="qkv_format"):
        packed_boundaries(PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu), 12)
    with pytest.raises(ConfigError, match="packed length"):
        packed_boundaries(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu), 14)


@pytest.mark.parametrize("flag", ["--compare-vanilla", "--bisect", "--rollout=2"])
def test_checker_refuses_what_packed_does_not_combine_with(flag):
    from mindspeed_tp import ConfigError
    from mindspeed_tp.check.main import resolve_args

    with pytest.raises(ConfigError, match="--packed"):
        resolve_args(["--packed", flag])
