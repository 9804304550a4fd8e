"""The selected-row MoE dispatch (kernels/moe_dispatch.py) on 4 gloo ranks: bitwise the dense slot
path it replaced, and each rank sends only its own T*k token slots (times the expert-TP size) where
the dense path sent (W-1)*T*k rows. One torchrun launch for every assert."""
import pytest
import torch
from safetensors.torch import load_file

from conftest import bits_equal, explain, run_torchrun

LAYOUTS = ["ep4", "ep2-etp2-blocks", "ep2-etp2-interleaved"]
EXPERT_TP = {"ep4": 1, "ep2-etp2-blocks": 2, "ep2-etp2-interleaved": 2}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe-dispatch") / "out.safetensors"
    proc = run_torchrun("moe_dispatch.py", 4, str(path))
    assert proc.returncode == 0, explain(proc)
    return load_file(str(path))


def test_dispatch_is_bitwise_the_dense_slot_path(result):
    for layout in LAYOUTS:
        outputs = result[f"{layout}/outputs"]  # (rank, [selected, dense], T, k, H) as int16 bits
        for rank in range(outputs.shape[0]):
            assert bits_equal(outputs[rank, 0], outputs[rank, 1]), (layout, rank)


def test_each_rank_sends_only_its_own_token_slots(result):
    tokens, k, h, world = result["shape"].tolist()
    slot_elements = tokens * k * h
    for layout in LAYOUTS:
        sent = result[f"{layout}/sent"]  # per rank: dispatched, returned, dense, backward ran
        dispatched, returned, dense, backward_ran = sent.unbind(1)
        assert torch.all(dispatched <= EXPERT_TP[layout] * slot_elements), (layout, dispatched)
        # Every slot's output comes back once (from its owner), so the group returns at most W*T*k rows.
        assert int(returned.sum()) <= world * slot_elements, (layout, returned)
        assert torch.all(dense == (world - 1) * slot_elements), (layout, dense)
        assert torch.all(backward_ran == 1), layout
