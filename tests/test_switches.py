"""The four switches apply the same patch set exactly once, and disable() restores vanilla."""
import textwrap

import pytest

from conftest import explain, run_python

REPORT = textwrap.dedent(
    """
    import megatron.core.tensor_parallel.layers as L
    import mindspeed_tp
    from mindspeed_tp import state
    from mindspeed_tp.patches import registry
    reg = registry()
    print("APPLIED", sum(p.applied for p in reg.patches), "OF", len(reg.patches))
    print("ROWFWD", L.RowParallelLinear.forward.__module__)
    # A patch applied twice would have one of our own patch functions as its "original".
    print("ORIGINALS", not any(str(getattr(getattr(p._original, "__func__", p._original), "__module__", ""))
                               .startswith("mindspeed_tp.patches") for p in reg.patches if p.applied))
    print("PROFILE", state.profile().name if state.enabled() else None)
    """
)


def _applied(proc):
    assert proc.returncode == 0, explain(proc)
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    return lines


def _assert_all_applied_once(lines):
    applied, _, total = lines["APPLIED"].split()
    assert applied == total and int(total) > 0
    assert lines["ROWFWD"] == "mindspeed_tp.patches.tensor_parallel"
    assert lines["ORIGINALS"] == "True"  # no patch wraps another patch: applied exactly once


def test_import_megatron_adaptor():
    lines = _applied(run_python("import mindspeed_tp.megatron_adaptor\nimport mindspeed_tp; mindspeed_tp.enable()\n" + REPORT))
    _assert_all_applied_once(lines)
    assert lines["PROFILE"] == "default"


def test_enable_with_profile_path_twice(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nattention_block_size: 64\n")
    code = f"import mindspeed_tp\nmindspeed_tp.enable({str(path)!r})\nmindspeed_tp.enable({str(path)!r})\n" + REPORT
    lines = _applied(run_python(code))
    _assert_all_applied_once(lines)
    assert lines["PROFILE"] == "mine"


def test_environment_variable_alone(tmp_path):
    """MINDSPEED_TP=1 with no mindspeed_tp import in the script: the installed .pth hook enables
    the patches right after megatron.core is imported."""
    path = tmp_path / "envp.yaml"
    path.write_text("name: from-env\n")
    code = "import megatron.core.tensor_parallel.layers as L\nprint('ROWFWD0', L.RowParallelLinear.forward.__module__)\n" + REPORT
    lines = _applied(run_python(code, env={"MINDSPEED_TP": "1", "MINDSPEED_TP_PROFILE": str(path)}))
    assert lines["ROWFWD0"] == "mindspeed_tp.patches.tensor_parallel"
    _assert_all_applied_once(lines)
    assert lines["PROFILE"] == "from-env"


def test_without_any_switch_nothing_is_patched():
    lines = _applied(run_python("import megatron.core.tensor_parallel.layers as L\nprint('ROWFWD', L.RowParallelLinear.forward.__module__)"))
    assert lines["ROWFWD"] == "megatron.core.tensor_parallel.layers"


STANDIN_ARGUMENTS = '''
"""Stand-in for megatron/training/arguments.py (Megatron-LM is not on the package index).
It reproduces the one interface the switch relies on: parse_args(extra_args_provider=None,
ignore_unknown_args=False) building an argparse parser and passing it to the provider. It proves
the flags register and enable through that interface, not anything about Megatron-LM's other args."""
import argparse


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
    else:
        args = parser.parse_args()
    return args
'''


def _standin(tmp_path):
    pkg = tmp_path / "standin" / "megatron" / "training"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "arguments.py").write_text(STANDIN_ARGUMENTS)
    return str(tmp_path / "standin")


def test_training_flags_enable_the_patches(tmp_path):
    """A training script that only imports megatron.training and parses its args: the flags exist
    (registered by the installed hook) and --true-on-policy-profile enables with that profile."""
    prof = tmp_path / "flag.yaml"
    prof.write_text("name: from-flag\n")
    code = textwrap.dedent(
        f"""
        import sys
        sys.argv = ["pretrain_gpt.py", "--tensor-model-parallel-size", "2", "--true-on-policy",
                    "--true-on-policy-profile", {str(prof)!r}]
        from megatron.training.arguments import parse_args
        args = parse_args()
        print("FLAG", args.true_on_policy, args.tensor_model_parallel_size)
        """
    ) + REPORT
    lines = _applied(run_python(code, env={"PYTHONPATH": _standin(tmp_path)}))
    assert lines["FLAG"] == "True 2"
    _assert_all_applied_once(lines)
    assert lines["PROFILE"] == "from-flag"


def test_a_profile_whose_logprob_semantics_megatron_training_does_not_compute_is_refused(tmp_path):
    """Issue #55: a profile's logprob_semantics processed / temperature was accepted for Megatron-LM
    training, whose loss scores raw logprobs; refused by name before anything is patched."""
    from types import SimpleNamespace

    import mindspeed_tp
    from mindspeed_tp import state
    from mindspeed_tp.integrations.megatron_training import apply_true_on_policy_args

    def active():  # what an earlier test of this process may have left enabled, or None
        return state.profile().name if mindspeed_tp.is_enabled() else None

    before = active()
    for semantics in ("processed", "temperature"):
        prof = tmp_path / f"{semantics}.yaml"
        prof.write_text(f"name: {semantics}\nlogprob_semantics: {semantics}\n")
        with pytest.raises(mindspeed_tp.ConfigError, match=f"logprob_semantics is '{semantics}'.*raw logprobs"):
            apply_true_on_policy_args(SimpleNamespace(true_on_policy=True, true_on_policy_profile=str(prof)))
        assert active() == before  # refused before anything was enabled or switched
    assert apply_true_on_policy_args(SimpleNamespace(true_on_policy=False, true_on_policy_profile=None)) is False


def test_training_flags_absent_means_vanilla(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        sys.argv = ["pretrain_gpt.py"]
        from megatron.training.arguments import parse_args
        args = parse_args()
        import mindspeed_tp
        print("FLAG", args.true_on_policy, mindspeed_tp.is_enabled())
        """
    )
    lines = _applied(run_python(code, env={"PYTHONPATH": _standin(tmp_path)}))
    assert lines["FLAG"] == "False False"


def test_disable_restores_every_original():
    code = textwrap.dedent(
        """
        import megatron.core.tensor_parallel.layers as L
        import megatron.core.tensor_parallel as T
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        # CPU shims are not numerics and stay installed; enable() would install them first.
        from mindspeed_tp.devices.cpu_shims import install_cpu_shims
        install_cpu_shims()
        before = (L.RowParallelLinear.forward, T.vocab_parallel_cross_entropy, WrappedTorchNorm.__dict__["__new__"],
                  L.linear_with_grad_accumulation_and_async_allreduce)
        import mindspeed_tp
        mindspeed_tp.enable()
        during = (L.RowParallelLinear.forward, T.vocab_parallel_cross_entropy, WrappedTorchNorm.__dict__["__new__"],
                  L.linear_with_grad_accumulation_and_async_allreduce)
        mindspeed_tp.disable()
        after = (L.RowParallelLinear.forward, T.vocab_parallel_cross_entropy, WrappedTorchNorm.__dict__["__new__"],
                 L.linear_with_grad_accumulation_and_async_allreduce)
        print("CHANGED", all(a is not b for a, b in zip(before, during)))
        print("RESTORED", all(a is b for a, b in zip(before, after)))
        """
    )
    lines = _applied(run_python(code))
    assert lines["CHANGED"] == "True" and lines["RESTORED"] == "True"


def test_enable_reentered_from_the_import_hook_records_megatrons_originals():
    """On a full GPU install (TE and apex present) no shim imports megatron-core first, so enable()'s
    own patching imports it, and the MINDSPEED_TP=1 post-import hook re-enters enable(). Simulated:
    no shim group to install, the hook registered by hand. The registry must record megatron's
    functions as the originals, so disable() restores vanilla."""
    code = textwrap.dedent("""
        import sys
        import mindspeed_tp, mindspeed_tp_autoload
        from mindspeed_tp import switch
        switch.enable_groups = lambda: []
        print("MEGATRON_BEFORE", "megatron.core" in sys.modules)
        mindspeed_tp_autoload.when_imported("megatron.core", lambda m: mindspeed_tp.enable())
        mindspeed_tp.enable()
        import megatron.core.tensor_parallel.layers as L
        from mindspeed_tp.patches import registry
        ours = [p.target for p in registry().patches if p.applied and
                str(getattr(getattr(p._original, "__func__", p._original), "__module__", "")).startswith("mindspeed_tp")]
        print("OURS_AS_ORIGINAL", ours)
        mindspeed_tp.disable()
        print("AFTER_DISABLE", L.linear_with_grad_accumulation_and_async_allreduce.__module__,
              L.RowParallelLinear.forward.__module__)
    """)
    lines = _applied(run_python(code))
    assert lines["MEGATRON_BEFORE"] == "False"
    assert lines["OURS_AS_ORIGINAL"] == "[]"
    assert lines["AFTER_DISABLE"] == "megatron.core.tensor_parallel.layers megatron.core.tensor_parallel.layers"


def test_disable_leaves_mindspeed_tps_own_modules_alone():
    """disable() rebinds the patched names in megatron's modules and in modules that imported them,
    never in mindspeed_tp's own (they call their own functions by name)."""
    code = textwrap.dedent("""
        import mindspeed_tp
        import mindspeed_tp.patches.tensor_parallel as tp
        mindspeed_tp.enable()
        mindspeed_tp.disable()
        print("OWN", tp.consistent_linear.__module__, tp.vocab_parallel_cross_entropy.__module__)
    """)
    lines = _applied(run_python(code))
    assert lines["OWN"] == "mindspeed_tp.patches.tensor_parallel mindspeed_tp.patches.tensor_parallel"


def test_disable_reverts_the_integrations_and_the_optimizer_hook():
    """The import-time patches (Megatron-LM's parse_args here, from a stand-in module registered
    under its name) and the rollout-layout optimizer hook are registry entries: disable() removes
    them, enable() puts them back."""
    code = textwrap.dedent("""
        import sys, types
        import torch
        import torch.optim.optimizer as opt
        args_module = types.ModuleType("megatron.training.arguments")
        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            return "vanilla"
        args_module.parse_args = parse_args
        vanilla = {"parse_args": parse_args}  # not a module global: the registry rebinds those too
        sys.modules["megatron.training.arguments"] = args_module
        import mindspeed_tp
        from mindspeed_tp import integrations
        integrations.registry().apply_imported("megatron.training.arguments")
        print("WRAPPED", args_module.parse_args is not vanilla["parse_args"])
        hooks_before = len(opt._global_optimizer_post_hooks)
        mindspeed_tp.enable()
        print("HOOK_ON", len(opt._global_optimizer_post_hooks) - hooks_before)
        mindspeed_tp.disable()
        print("RESTORED", args_module.parse_args is vanilla["parse_args"],
              len(opt._global_optimizer_post_hooks) - hooks_before)
        mindspeed_tp.enable()
        print("REAPPLIED", args_module.parse_args is not vanilla["parse_args"])
    """)
    lines = _applied(run_python(code))
    assert lines["WRAPPED"] == "True"
    assert lines["HOOK_ON"] == "1"
    assert lines["RESTORED"] == "True 0"
    assert lines["REAPPLIED"] == "True"


def test_cpu_shims_installed_after_enable_still_let_disable_restore_vanilla():
    """A CPU shim and the norm patch share a target: shims installed after enable() go under the
    numerics patches, so disable() restores the shimmed vanilla norm, not ours."""
    code = textwrap.dedent("""
        import mindspeed_tp
        from mindspeed_tp import switch
        switch.enable_groups = lambda: []   # enable() installs no shims (TE and apex present)
        mindspeed_tp.enable()
        from mindspeed_tp.devices.cpu_shims import install_cpu_shims
        install_cpu_shims()
        import types
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        config = types.SimpleNamespace(normalization="RMSNorm", sequence_parallel=True, persist_layer_norm=False,
                                       layernorm_zero_centered_gamma=False, memory_efficient_layer_norm=False)
        print("ENABLED", type(WrappedTorchNorm(config, 8)).__name__)
        mindspeed_tp.disable()
        print("DISABLED", type(WrappedTorchNorm(config, 8)).__name__)
    """)
    lines = _applied(run_python(code))
    assert lines["ENABLED"] == "ConsistentNorm"
    assert lines["DISABLED"] == "RMSNorm"  # torch's, built by the SP shim around vanilla


def test_enable_on_a_cuda_machine_selects_triton_and_needs_it():
    """CUDA tensors run the triton backend; without an importable triton, enable() is a clear error
    (never the torch kernels on cuBLAS, which are not batch-invariant)."""
    code = textwrap.dedent("""
        import sys
        import torch
        torch.cuda.is_available = lambda: True
        import mindspeed_tp
        from mindspeed_tp.kernels import dispatch
        sys.modules["triton"] = None  # triton not installed
        try:
            mindspeed_tp.enable()
        except mindspeed_tp.ConfigError as exc:
            print("REFUSED", exc)
        print("ENABLED", mindspeed_tp.is_enabled())
        del sys.modules["triton"]
        mindspeed_tp.enable()
        cuda_like = type("T", (), {"device": torch.device("cuda", 0)})()
        print("AUTO_ON_CUDA", dispatch.backend_name(cuda_like), dispatch.kernel("matmul", cuda_like).__module__)
        mindspeed_tp.disable()
        dispatch.select("torch")
        try:
            dispatch.kernel("matmul", cuda_like)
        except mindspeed_tp.ConfigError as exc:
            print("TORCH_ON_CUDA", exc)
    """)
    lines = _applied(run_python(code))
    assert "'triton'" in lines["REFUSED"] and "backend: torch" in lines["REFUSED"]
    assert lines["ENABLED"] == "False"
    assert lines["AUTO_ON_CUDA"] == "triton mindspeed_tp.kernels.backends.triton"
    assert "not batch-invariant on cuda" in lines["TORCH_ON_CUDA"]


def test_untested_megatron_line_warns_naming_the_tested_lines():
    code = textwrap.dedent("""
        import warnings
        import mindspeed_tp
        from mindspeed_tp import compat
        compat.megatron_version = lambda: "0.99.0"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mindspeed_tp.enable()
        print("WARNED", [str(w.message) for w in caught if "not a tested line" in str(w.message)])
    """)
    lines = _applied(run_python(code))
    assert "0.99.0 is not a tested line (tested: 0.12.x, 0.16.x, 0.19.x)" in lines["WARNED"]
    assert "MINDSPEED_TP_ALLOW_UNTESTED_MEGATRON=1" in lines["WARNED"]


def test_disable_ends_what_enable_set_up_and_keeps_what_was_there_before():
    """The CPU shims enable() installed go with disable() (shims installed before it stay); the
    explicit vocab size is cleared, so it does not apply to the next model of the process."""
    code = textwrap.dedent("""
        import mindspeed_tp
        from mindspeed_tp import state
        from mindspeed_tp.devices.cpu_shims import install_cpu_shims, shim_registry
        mindspeed_tp.enable()
        mindspeed_tp.set_vocab_size(1000)
        print("ON", shim_registry().applied, state.explicit_vocab_size())
        mindspeed_tp.disable()
        print("OFF", shim_registry().applied, state.explicit_vocab_size())
        install_cpu_shims()
        mindspeed_tp.enable()
        mindspeed_tp.disable()
        print("KEPT", shim_registry().applied)
    """)
    lines = _applied(run_python(code))
    assert lines["ON"] == "True 1000"
    assert lines["OFF"] == "False None"
    assert lines["KEPT"] == "True"
