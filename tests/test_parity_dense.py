"""tiny-dense on real megatron-core GPTModel: every TP x SP x PP layout gives logprobs bitwise
equal to the single-device run with mindspeed-tp, and vanilla megatron-core does not (bf16)."""
import json

import pytest
from safetensors.torch import load_file

from conftest import bits_equal, explain, run_cli, tiered

pytestmark = pytest.mark.version_lines  # also run on megatron-core 0.12.x (scripts/test.sh)

ALL_LAYOUTS = ["tp1", "tp2", "tp2-sp", "tp4", "tp4-sp", "tp1-pp2", "tp2-pp2", "tp2-sp-pp2", "tp4-pp2", "tp4-sp-pp2"]
# The CI tier and the other megatron-core lines: TP 2 and 4, SP, a pipeline (one world of 4), bf16.
LAYOUTS = tiered("test_parity_dense.py: layouts of the checker launch", ["tp2-sp", "tp4", "tp1-pp2", "tp2-sp-pp2"],
                 ALL_LAYOUTS, "TP 2 and 4, SP and a pipeline, alone and combined: every kind of split the other "
                 "layouts combine; the tree makes TP 1, 2 and 4 the same by construction")
DTYPES = tiered("test_parity_dense.py: dtypes", ["bf16"], ["fp32", "bf16"],
                "fp32 scoring across layouts in the CI tier: test_gemm_invariance.py::"
                "test_non_power_of_two_hidden_and_ffn_are_bitwise_in_fp32 (tp1, tp2, tp2-sp-pp2)")
REQUIRED_KEYS = {"max_abs_logdiff", "mean_abs_logdiff", "bitwise_equal_fraction", "max_abs_probdiff", "pearson",
                 "tokens", "layout", "profile", "vanilla", "megatron_core_version"}


_RUNS = {}


def _matrix(dtype, tmp_path_factory):
    """One checker run per dtype, shared by every test that reads it (cached by dtype: pytest's
    TempPathFactory is not hashable, so no lru_cache over it)."""
    if dtype in _RUNS:
        return _RUNS[dtype]
    out = tmp_path_factory.mktemp(f"parity-{dtype}")
    proc = run_cli("check", "--layouts", ",".join(LAYOUTS), "--dtype", dtype, "--compare-vanilla",
                   "--dump-logprobs", str(out), "--json", str(out / "report.json"))
    assert proc.returncode == 0, explain(proc)
    tensors = load_file(str(out / "logprobs.safetensors"))
    report = json.loads((out / "report.json").read_text())
    _RUNS[dtype] = dtype, tensors, report, proc.stdout
    return _RUNS[dtype]


@pytest.fixture(scope="module", params=DTYPES)
def matrix(request, tmp_path_factory):
    return _matrix(request.param, tmp_path_factory)


def test_every_layout_bitwise_equal_to_single_device(matrix):
    dtype, t, _, _ = matrix
    ref = t["consistent/reference"]
    for layout in LAYOUTS:
        assert bits_equal(t[f"consistent/{layout}"], ref), f"{dtype} {layout} differs from TP=PP=1"


def test_vanilla_megatron_is_not_bitwise_equal(matrix):
    """In fp32 partial sums round less, so fewer tokens differ (61 % stay equal at TP=2), but
    vanilla's cross-rank sums still change bits in every TP>1 layout, as in bf16."""
    dtype, t, _, _ = matrix
    scored = t["scored"]
    ref = t["vanilla/reference"][scored]
    # TP=1 layouts have no cross-rank sum: vanilla is exact there as well.
    for layout in [l for l in LAYOUTS if not l.startswith("tp1")]:
        assert not bits_equal(t[f"vanilla/{layout}"][scored], ref), f"vanilla {dtype} {layout} unexpectedly equal"


def test_report_has_the_documented_keys(matrix):
    dtype, t, report, stdout = matrix
    assert report["all_bitwise_equal"] is True
    assert len(report["results"]) == 2 * len(LAYOUTS)
    for r in report["results"]:
        assert REQUIRED_KEYS <= set(r)
        if not r["vanilla"]:
            assert r["bitwise_equal_fraction"] == 1.0 and r["max_abs_logdiff"] == 0.0
    assert "RESULT: bitwise equal" in stdout
