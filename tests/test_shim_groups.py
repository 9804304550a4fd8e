"""The shims come in groups keyed by the condition each answers (devices/cpu_shims.py): megatron-core
without Transformer Engine or apex on any device, gloo worlds, and the CUDA stand-ins only where no
accelerator is present, and never by enable(). What this proves: the grouping, the condition logic
and what enable() installs, on CPU; a GPU checker installing only the first two is exercised by
scripts/device_check.sh."""
import textwrap

import pytest

from mindspeed_tp import devices
from mindspeed_tp.devices import cpu_shims

from conftest import explain, run_python


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


def test_enable_in_a_users_cpu_only_process_installs_no_cuda_stand_in():
    """A user's CPU-only driver (verl's, for one) that calls enable() keeps torch.cuda and
    Tensor.cuda: only the groups whose condition holds anywhere are installed (megatron-core
    without TE/apex, gloo), and disable() takes back what enable() installed."""
    code = textwrap.dedent("""
        import torch
        import mindspeed_tp
        from mindspeed_tp.devices import cpu_shims
        before = (torch.Tensor.cuda, torch.cuda.current_device, torch.cuda.Stream)
        mindspeed_tp.enable()
        print("ACCELERATOR", torch.cuda.is_available())
        print("APPLIED", sorted(n for n, g in cpu_shims.GROUPS.items() if g.applied))
        print("CUDA_KEPT", (torch.Tensor.cuda, torch.cuda.current_device, torch.cuda.Stream) == before)
        mindspeed_tp.disable()
        print("AFTER", sorted(n for n, g in cpu_shims.GROUPS.items() if g.applied))
    """)
    proc = run_python(code)
    assert proc.returncode == 0, explain(proc)
    lines = dict(l.split(" ", 1) for l in proc.stdout.splitlines() if " " in l)
    assert lines["ACCELERATOR"] == "False"  # this machine: the case the stand-ins used to be installed in
    assert lines["APPLIED"] == "['gloo', 'no_te_apex']"
    assert lines["CUDA_KEPT"] == "True"
    assert lines["AFTER"] == "[]"


def test_the_gloo_shim_passes_uneven_gathers_through_off_gloo(monkeypatch):
    """Installed by enable() before the world exists, the gloo shim must leave another backend's
    uneven all-gather to megatron-core: it reads the group's backend at each call."""
    import torch
    import torch.distributed as dist

    patch = next(p for p in cpu_shims.GROUPS["gloo"].patches)
    calls = []

    def original(input_, group=None, output_split_sizes=None, use_global_buffer=False):
        calls.append((group, output_split_sizes))
        return input_

    gather = patch.replacement(original)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    x = torch.ones(3, 2)
    assert gather(x, "tp-group", [3, 2]) is x
    assert calls == [("tp-group", [3, 2])]
