"""The four switches apply the same patch set exactly once, and disable() restores vanilla."""
import textwrap

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
        from mindspeed_tp.backends.cpu_shims import install_cpu_shims
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
