"""The checker's processes import megatron-core with torch.compile deferred to each function's
first call (mindspeed_tp/check/deferred_compile.py): the same compile, with the same arguments,
happens at the first call instead of at import; nothing else changes."""
import torch

from mindspeed_tp.check.deferred_compile import deferring

from conftest import explain, run_python


def _recording_compile(calls):
    def real(model, **kwargs):
        calls.append((model, kwargs))
        return lambda *a, **k: ("compiled", model(*a, **k))

    return real


def test_a_function_is_compiled_once_at_its_first_call_with_every_argument():
    calls = []
    compile_later = deferring(_recording_compile(calls))

    def plain(x, scale=1):
        return x * scale

    for decorated, kwargs in ((compile_later(plain), {}),
                              (compile_later(fullgraph=True, dynamic=False)(plain), {"fullgraph": True,
                                                                                      "dynamic": False})):
        calls.clear()
        assert calls == [] and decorated.__name__ == "plain"
        assert decorated(3, scale=2) == ("compiled", 6) and decorated(4) == ("compiled", 4)
        assert calls == [(plain, kwargs)]  # compiled once, at the first call


def test_a_module_is_compiled_at_once():
    calls = []
    module = torch.nn.Linear(2, 2)
    deferring(_recording_compile(calls))(module, mode="max-autotune")
    assert calls == [(module, {"mode": "max-autotune"})]


def test_the_checker_imports_megatron_without_the_compiler_and_runs_its_fused_functions():
    proc = run_python(
        "import sys, torch\n"
        "real = torch.compile\n"
        "import mindspeed_tp.check\n"
        "import megatron.core.jit as jit\n"
        "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu\n"
        "assert torch.compile is real, 'torch.compile is restored after the import'\n"
        "assert jit.jit_fuser.__qualname__.startswith('deferring'), jit.jit_fuser\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules\n"
        "y = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))\n"
        "b = torch.randn(8, generator=torch.Generator().manual_seed(1))\n"
        "eager = torch.nn.functional.silu((y + b)[:, :4]) * (y + b)[:, 4:]\n"
        "out = bias_swiglu(y, b)\n"
        "assert 'torch._inductor.compile_fx' in sys.modules  # compiled at the first call\n"
        "torch.testing.assert_close(out, eager)\n"
        "print('ok')\n", timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, explain(proc)


def test_the_autoload_hook_still_enables_the_patches_after_the_deferred_import():
    """MINDSPEED_TP=1 in a test process (tests/startup defers the compiles at interpreter start):
    the package's .pth hook still enables the patches right after megatron.core is imported, and
    torch.compile is the real one again by then."""
    proc = run_python(
        "import torch\n"
        "real = torch.compile\n"
        "import megatron.core.jit as jit\n"
        "import megatron.core.tensor_parallel.layers as L\n"
        "import mindspeed_tp\n"
        "assert mindspeed_tp.is_enabled()\n"
        "assert L.RowParallelLinear.forward.__module__ == 'mindspeed_tp.patches.tensor_parallel'\n"
        "assert torch.compile is real\n"
        "assert jit.jit_fuser.__qualname__.startswith('deferring'), jit.jit_fuser\n"
        "print('ok')\n", env={"MINDSPEED_TP": "1"}, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, explain(proc)
