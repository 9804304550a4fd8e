"""The shims come in groups keyed by the condition each answers (devices/cpu_shims.py): megatron-core
without Transformer Engine or apex on any device, gloo worlds, and the CUDA stand-ins only where no
accelerator is present. What this proves: the grouping and the condition logic, on CPU; a GPU
checker installing only the first two is exercised by scripts/device_check.sh."""
import pytest

from mindspeed_tp import devices
from mindspeed_tp.devices import cpu_shims


@pytest.fixture
def machine(monkeypatch):
    def set_machine(accelerator: bool, te: bool, apex: bool):
        monkeypatch.setattr(devices, "accelerator_available", lambda: accelerator)
        present = {"transformer_engine": te, "apex": apex}
        monkeypatch.setattr(cpu_shims, "_importable", lambda name: present[name])
    return set_machine


@pytest.mark.parametrize("accelerator,te,apex,backend,expected", [
    (False, False, False, "gloo", ["no_te_apex", "gloo", "cuda_standins"]),   # this CPU checker
    (True, False, False, "gloo", ["no_te_apex", "gloo"]),                     # a GPU, host-staged gloo
    (True, False, False, "nccl", ["no_te_apex"]),                             # a GPU without TE/apex
    (True, True, False, "nccl", ["no_te_apex"]),                              # TE but no apex: torch norms
    (True, True, True, "nccl", []),                                           # a full GPU install
    (True, True, True, None, []),
])
def test_groups_follow_the_condition_each_answers(machine, accelerator, te, apex, backend, expected):
    machine(accelerator, te, apex)
    assert cpu_shims.needed_groups(backend) == expected


def test_every_cuda_call_is_a_stand_in_and_the_gpu_groups_hold_none():
    by_group = {name: [p.target for p in reg.patches] for name, reg in cpu_shims.GROUPS.items()}
    cuda = [t for targets in by_group.values() for t in targets if t.startswith(("torch.cuda:", "torch:Tensor.cuda"))]
    assert cuda and all(t in by_group["cuda_standins"] for t in cuda)
    assert "megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__" in by_group["no_te_apex"]
    assert "megatron.core.transformer.moe.moe_utils:te_general_gemm" in by_group["no_te_apex"]
    assert by_group["gloo"] == ["megatron.core.tensor_parallel.mappings:_gather_along_first_dim"]
    targets = [t for targets in by_group.values() for t in targets]
    assert len(targets) == len(set(targets))  # one group per shim
