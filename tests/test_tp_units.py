"""megatron-core tensor-parallel layers under the patches, TP=2/4 vs TP=1, bit for bit."""
import pytest
from safetensors.torch import load_file

from conftest import bits_equal, explain, run_torchrun

pytestmark = pytest.mark.version_lines  # also run on megatron-core 0.12.x (scripts/test.sh)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-units") / "out.safetensors"
    proc = run_torchrun("tp_units.py", 4, str(path))
    assert proc.returncode == 0, explain(proc)
    return load_file(str(path))


LAYOUTS = ["tp2", "tp2-sp", "tp4", "tp4-sp"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["row", "column", "logprob"])
def test_patched_layers_equal_tp1(outputs, dtype, kind):
    ref = outputs[f"consistent/{dtype}/tp1/{kind}"]
    for layout in LAYOUTS:
        assert bits_equal(outputs[f"consistent/{dtype}/{layout}/{kind}"], ref), f"{kind} {layout} {dtype}"


def test_row_parallel_all_reduce_and_reduce_scatter_paths_both_covered(outputs):
    # tp2 uses the all-reduce replacement, tp2-sp the reduce-scatter one; both must match TP=1
    # and each other, for a K (96) that C=8 splits into 12-column leaves.
    a, b = outputs["consistent/bf16/tp2/row"], outputs["consistent/bf16/tp2-sp/row"]
    assert bits_equal(a, b)


def test_vanilla_row_parallel_differs_in_bf16(outputs):
    ref = outputs["vanilla/bf16/tp1/row"]
    assert any(not bits_equal(outputs[f"vanilla/bf16/{l}/row"], ref) for l in LAYOUTS)
