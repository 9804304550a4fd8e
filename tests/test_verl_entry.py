"""The verl entry point (VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl) against a stand-in verl
package (tests/fakes/verl_standin: verl's import of external modules, its Megatron logprob
function and an actor module importing it by name, as verl does); verl itself is not installed."""
import os

import torch
from safetensors.torch import load_file

from conftest import ROOT, explain, run_python, run_torchrun

ENV = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "fakes", "verl_standin")]),
       "VERL_USE_EXTERNAL_MODULES": "mindspeed_tp.verl"}


def test_fresh_process_with_only_the_environment_variable():
    """verl-style smoke test: `import verl` in a fresh process, nothing else, ends with every patch
    applied, the actor's logprob function bound to mindspeed-tp's, and verl's request for the
    Transformer Engine layer spec answered with the local one (TE is not installed here: the TE
    spec would fail to build)."""
    code = (
        "import verl\n"
        "import mindspeed_tp\n"
        "from mindspeed_tp.patches import registry\n"
        "from verl.workers.actor import megatron_actor\n"
        "reg = registry()\n"
        "print('ENABLED', mindspeed_tp.is_enabled(), sum(p.applied for p in reg.patches) == len(reg.patches))\n"
        "print('ACTOR', megatron_actor.vocab_parallel_log_probs_from_logits.__module__)\n"
        "from mindspeed_tp.check.harness import _setup_parallel_state, init_distributed\n"
        "from mindspeed_tp.check.models.layout import Layout\n"
        "init_distributed(); _setup_parallel_state(Layout(), 0)  # the spec reads the pipeline rank\n"
        "from megatron.core.transformer.transformer_config import TransformerConfig\n"
        "from verl.models.mcore import model_initializer\n"
        "cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, normalization='RMSNorm')\n"
        "spec = model_initializer.dense_layer_spec(cfg)\n"
        "print('SPEC', spec.layer_specs[0].submodules.self_attention.submodules.core_attention.__name__)\n"
    )
    proc = run_python(code, env=ENV)
    assert proc.returncode == 0, explain(proc)
    assert "ENABLED True True" in proc.stdout
    assert "ACTOR mindspeed_tp.integrations.verl" in proc.stdout
    assert "SPEC DotProductAttention" in proc.stdout


def test_actor_logprob_at_tp2_equals_tp1_bitwise(tmp_path):
    path = tmp_path / "verl.safetensors"
    proc = run_torchrun("verl_logprob.py", 2, str(path), env=ENV)
    assert proc.returncode == 0, explain(proc)
    out = load_file(str(path))
    assert torch.equal(out["ours"], out["tp1"])
    # After disable() the actor runs verl's own path again (Megatron's cross entropy): a sanity
    # check that it computes the same quantity, not a bitwise claim.
    assert torch.isfinite(out["verl_own"]).all()
    assert torch.allclose(out["verl_own"], out["ours"], atol=1e-4)
