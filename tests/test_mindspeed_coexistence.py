"""mindspeed-tp next to MindSpeed.

MindSpeed itself is not installable here (the package index holds only a placeholder,
mindspeed-0.0.1.dev1, whose setup raises "This project is not functional and is a placeholder"),
so these tests run against tests/fakes/mindspeed_standin: a patch manager that behaves like
MindSpeed's (rebinding a replaced object in every loaded module, wrappers, remove/re-apply,
features with args and patches), whose replacements of the targets mindspeed-tp also patches raise
if they run. They prove the patching order, take-back, refusal and flag registration against that
behaviour; they do not prove anything about MindSpeed's real kernels.
"""
import json
import os
import textwrap

import pytest

from conftest import ROOT, STARTUP, explain, run_python, run_torchrun

pytestmark = pytest.mark.version_lines  # also run on megatron-core 0.12.x (scripts/test.sh)

STANDIN = os.path.join(ROOT, "tests", "fakes", "mindspeed_standin")
ENV = {"PYTHONPATH": os.pathsep.join([ROOT, STARTUP, STANDIN])}


def _run(code: str):
    proc = run_python(textwrap.dedent(code), env=ENV)
    assert proc.returncode == 0, explain(proc)
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)


def test_checker_is_bitwise_with_mindspeed_adaptor_imported_first(tmp_path):
    """A MindSpeed-style script (stand-in adaptor with flash attention on, then
    mindspeed_tp.megatron_adaptor) runs the TP=2/SP checker bitwise equal to TP=1: none of the
    stand-in's raising replacements ran."""
    report = tmp_path / "r.json"
    proc = run_torchrun("check_after_mindspeed.py", 2, "--tp", "2", "--sp", "--dtype", "bf16", "--seq-length", "64",
                        "--json", str(report), env=ENV)
    assert proc.returncode == 0, explain(proc)
    assert json.loads(report.read_text())["bitwise_equal_fraction"] == 1.0


def test_enable_after_mindspeed_wins_and_disable_restores_mindspeed():
    lines = _run("""
        import sys, types
        sys.argv = ["train.py", "--use-flash-attn"]
        import mindspeed.megatron_adaptor
        from mindspeed.features_manager import StandinNorm
        import megatron.core.tensor_parallel as tp
        import megatron.core.tensor_parallel.cross_entropy as ce
        import megatron.core.transformer.torch_norm as tn
        import megatron.core.models.gpt.gpt_layer_specs as specs
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        ms_attn, ms_ce = DotProductAttention.forward, ce.vocab_parallel_cross_entropy
        print("MS_BOUND", tn.WrappedTorchNorm is StandinNorm and specs.LNImpl is StandinNorm and tp.vocab_parallel_cross_entropy is ms_ce)
        import mindspeed_tp, mindspeed_tp.megatron_adaptor
        from mindspeed_tp.patches import registry
        from mindspeed_tp.patches.norms import ConsistentNorm
        from mindspeed_tp.patches.tensor_parallel import vocab_parallel_cross_entropy as ours_ce
        cfg = types.SimpleNamespace(normalization="RMSNorm", sequence_parallel=False)
        print("OURS_ATTN", DotProductAttention.forward.__module__)
        print("OURS_CE", ce.vocab_parallel_cross_entropy is ours_ce and tp.vocab_parallel_cross_entropy is ours_ce)
        print("OURS_NORM", type(specs.LNImpl(cfg, 16)).__name__)
        print("DISPLACED", [p.target for p in registry().displaced()])
        mindspeed_tp.disable()
        print("RESTORED", DotProductAttention.forward is ms_attn and ce.vocab_parallel_cross_entropy is ms_ce
              and tp.vocab_parallel_cross_entropy is ms_ce)
        try:
            StandinNorm(cfg, 16)
        except RuntimeError as exc:
            print("MS_NORM_AGAIN", "stand-in PTNorm" in str(exc))
    """)
    assert lines["MS_BOUND"] == "True"
    assert lines["OURS_ATTN"] == "mindspeed_tp.patches.attention"
    assert lines["OURS_CE"] == "True"
    assert lines["OURS_NORM"] == "ConsistentNorm"
    assert lines["DISPLACED"] == "[]"
    assert lines["RESTORED"] == "True" and lines["MS_NORM_AGAIN"] == "True"


def test_mindspeed_after_enable_repatch_and_a_foreign_rebinding():
    """MindSpeed's adaptor imported after enable() and its repatch() (what verl's workers call)
    leave mindspeed-tp's patches in place; a rebinding nobody told us about is listed by
    displaced(), refused at model build with the import-order fix named, and taken back by enable()."""
    lines = _run("""
        import sys
        import mindspeed_tp
        mindspeed_tp.enable()
        sys.argv = ["train.py", "--use-flash-attn"]
        import mindspeed.megatron_adaptor as adaptor
        from mindspeed.features_manager import MindSpeedFeaturesManager
        from mindspeed.patch_utils import MindSpeedPatchesManager
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from mindspeed_tp.patches import registry
        from mindspeed_tp.patches.models import check_not_displaced
        print("FEATURE", [type(f).__name__ for f in MindSpeedFeaturesManager.FEATURES_LIST][-1])
        print("AFTER_IMPORT", [p.target for p in registry().displaced()], DotProductAttention.forward.__module__)
        adaptor.repatch({"use_flash_attn": True})
        print("AFTER_REPATCH", [p.target for p in registry().displaced()], DotProductAttention.forward.__module__)
        def forward(self, *a, **k):
            raise RuntimeError("foreign attention ran")
        MindSpeedPatchesManager.register_patch(
            "megatron.core.transformer.dot_product_attention.DotProductAttention.forward", forward)
        MindSpeedPatchesManager.apply_patches()
        print("FOREIGN", [p.target for p in registry().displaced()])
        try:
            check_not_displaced(registry())
        except mindspeed_tp.ConfigError as exc:
            print("REFUSED", "mindspeed.megatron_adaptor" in str(exc) and "DotProductAttention.forward" in str(exc))
        mindspeed_tp.enable()
        print("TAKEN_BACK", [p.target for p in registry().displaced()], DotProductAttention.forward.__module__)
    """)
    assert lines["FEATURE"] == "TrueOnPolicyFeature"
    assert lines["AFTER_IMPORT"] == "[] mindspeed_tp.patches.attention"
    assert lines["AFTER_REPATCH"] == "[] mindspeed_tp.patches.attention"
    assert lines["FOREIGN"] == "['megatron.core.transformer.dot_product_attention:DotProductAttention.forward']"
    assert lines["REFUSED"] == "True"
    assert lines["TAKEN_BACK"] == "[] mindspeed_tp.patches.attention"


def test_true_on_policy_is_a_mindspeed_feature():
    """--true-on-policy parsed by MindSpeed's own argument parsing enables mindspeed-tp on top of
    MindSpeed's patches when the adaptor is imported; the flags are in MindSpeed's parser."""
    lines = _run("""
        import argparse, sys
        sys.argv = ["train.py", "--true-on-policy", "--use-flash-attn"]
        import mindspeed_tp
        import mindspeed.megatron_adaptor
        from mindspeed.features_manager import MindSpeedFeaturesManager
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from mindspeed_tp.patches import registry
        print("ENABLED", mindspeed_tp.is_enabled(), [p.target for p in registry().displaced()],
              DotProductAttention.forward.__module__)
        parser = argparse.ArgumentParser()
        MindSpeedFeaturesManager.register_features_args(parser)
        print("PARSED", parser.parse_args(["--true-on-policy-profile", "default"]).true_on_policy_profile)
    """)
    assert lines["ENABLED"] == "True [] mindspeed_tp.patches.attention"
    assert lines["PARSED"] == "default"


def test_contract_breaking_mindspeed_features_are_refused():
    """--use-ascend-mc2 with --true-on-policy: the MindSpeed feature refuses at adaptor import;
    --use-fused-rmsnorm: enable() refuses. Both name the flag."""
    lines = _run("""
        import sys
        import mindspeed_tp
        sys.argv = ["train.py", "--true-on-policy", "--use-ascend-mc2"]
        try:
            import mindspeed.megatron_adaptor
        except mindspeed_tp.ConfigError as exc:
            print("MC2", "--use-ascend-mc2" in str(exc) and "canonical tree" in str(exc))
    """)
    assert lines["MC2"] == "True"
    lines = _run("""
        import sys
        sys.argv = ["train.py", "--use-fused-rmsnorm"]
        import mindspeed.megatron_adaptor
        import mindspeed_tp
        try:
            mindspeed_tp.enable()
        except mindspeed_tp.ConfigError as exc:
            print("RMSNORM", "--use-fused-rmsnorm" in str(exc), mindspeed_tp.is_enabled())
    """)
    assert lines["RMSNORM"] == "True False"


def test_mindspeed_te_replacements_are_refused():
    """Under MindSpeed, megatron's TE layer names hold mindspeed.te classes, which no mindspeed-tp
    patch covers: the GPTModel guard refuses them by module and names the local spec."""
    import pytest
    import torch

    from mindspeed_tp import ConfigError
    from mindspeed_tp.patches.models import validate_model_modules

    layer = type("TEColumnParallelLinear", (torch.nn.Module,), {"__module__": "mindspeed.te.pytorch.module.linear"})
    with pytest.raises(ConfigError, match="local spec"):
        validate_model_modules(torch.nn.Sequential(layer()))
