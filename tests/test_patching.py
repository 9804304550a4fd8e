"""PatchRegistry on throwaway modules, and enable()/disable() against the real megatron-core."""
import sys
import types
import uuid

import pytest

from mindspeed_tp.errors import PatchImportError, PatchTargetError
from mindspeed_tp.patching import Patch, PatchRegistry

pytestmark = pytest.mark.version_lines  # also run on megatron-core 0.12.x (scripts/test.sh)


@pytest.fixture
def mods():
    """Two throwaway modules: ``a`` defines things, ``b`` did ``from a import f``."""
    tag = uuid.uuid4().hex[:8]
    a = types.ModuleType(f"_mstp_test_a_{tag}")
    b = types.ModuleType(f"_mstp_test_b_{tag}")

    def f(x):
        return ("orig-f", x)

    def other(x):
        return ("orig-other", x)

    class C:
        attr = "orig-attr"
        created = []

        def __new__(cls, *args):
            obj = super().__new__(cls)
            obj.made_by = "orig-new"
            return obj

        def method(self):
            return "orig-method"

    a.f, a.other, a.C = f, other, C
    b.f = a.f  # from a import f
    b.C = a.C
    sys.modules[a.__name__] = a
    sys.modules[b.__name__] = b
    try:
        yield types.SimpleNamespace(a=a, b=b, f=f, other=other, C=C,
                                    new=vars(C)["__new__"], method=vars(C)["method"])
    finally:
        sys.modules.pop(a.__name__, None)
        sys.modules.pop(b.__name__, None)


def _replacement_f(x):
    return ("new-f", x)


def test_apply_replaces_and_rebinds_importers(mods):
    reg = PatchRegistry("t")
    reg.register(f"{mods.a.__name__}:f", "test")(_replacement_f)
    active = reg.apply()
    assert [p.target for p in active] == [f"{mods.a.__name__}:f"]
    assert mods.a.f is _replacement_f
    assert mods.b.f is _replacement_f
    assert mods.b.f(1) == ("new-f", 1)
    assert reg.applied
    # untouched neighbours stay untouched
    assert mods.a.other is mods.other


def test_apply_is_idempotent_and_keeps_originals(mods):
    reg = PatchRegistry("t")
    calls = []

    def factory(original):
        calls.append(original)

        def wrapped(x):
            return ("wrapped",) + original(x)

        return wrapped

    reg.register(f"{mods.a.__name__}:f", "test", wraps=True)(factory)
    reg.register(f"{mods.a.__name__}:C.method", "test")(lambda self: "new-method")
    first = reg.apply()
    patched_f = mods.a.f
    patched_m = vars(mods.C)["method"]
    second = reg.apply()
    assert len(first) == len(second) == 2
    assert calls == [mods.f]  # the factory ran once: no double wrapping
    assert mods.a.f is patched_f and mods.b.f is patched_f
    assert vars(mods.C)["method"] is patched_m
    assert mods.a.f(2) == ("wrapped", "orig-f", 2)
    assert [p._original for p in reg.patches] == [mods.f, mods.method]
    reg.revert()
    assert mods.a.f is mods.f and mods.b.f is mods.f
    assert vars(mods.C)["method"] is mods.method


def test_revert_restores_functions_class_attrs_and_new(mods):
    reg = PatchRegistry("t")
    a = mods.a.__name__

    def new_new(cls, *args):
        obj = object.__new__(cls)
        obj.made_by = "patched-new"
        return obj

    reg.register(f"{a}:f", "fn")(_replacement_f)
    reg.register(f"{a}:C.attr", "class attr")("patched-attr")
    reg.register(f"{a}:C.method", "method")(lambda self: "patched-method")
    reg.register(f"{a}:C.__new__", "staticmethod-like __new__")(new_new)
    reg.apply()
    assert mods.C.attr == "patched-attr"
    assert mods.C().method() == "patched-method"
    assert mods.C().made_by == "patched-new"
    assert isinstance(vars(mods.C)["__new__"], staticmethod)  # wrapped like the original
    assert mods.b.C is mods.C  # a class is shared, not copied

    reg.revert()
    assert not reg.applied
    assert mods.a.f is mods.f and mods.b.f is mods.f
    assert vars(mods.C)["attr"] == "orig-attr"
    assert vars(mods.C)["method"] is mods.method
    assert vars(mods.C)["__new__"] is mods.new  # the very staticmethod object
    obj = mods.C()
    assert obj.made_by == "orig-new" and obj.method() == "orig-method"
    # reverting twice is harmless; re-applying works again
    reg.revert()
    assert mods.a.f is mods.f
    reg.apply()
    assert mods.a.f is _replacement_f and mods.b.f is _replacement_f
    reg.revert()
    assert mods.a.f is mods.f and mods.b.f is mods.f


def test_wraps_passes_the_original(mods):
    reg = PatchRegistry("t")
    seen = {}

    def f_factory(original):
        seen["f"] = original
        return lambda x: ("outer",) + original(x)

    def new_factory(original):
        seen["new"] = original

        def __new__(cls, *args):
            obj = original(cls, *args)
            obj.made_by += "+wrapped"
            return obj

        return __new__

    reg.register(f"{mods.a.__name__}:f", "t", wraps=True)(f_factory)
    reg.register(f"{mods.a.__name__}:C.__new__", "t", wraps=True)(new_factory)
    reg.apply()
    assert seen["f"] is mods.f
    assert seen["new"] is mods.new.__func__  # the callable behind the staticmethod
    assert mods.b.f(3) == ("outer", "orig-f", 3)
    assert mods.C().made_by == "orig-new+wrapped"
    reg.revert()
    assert mods.C().made_by == "orig-new"
    assert vars(mods.C)["__new__"] is mods.new


@pytest.mark.parametrize("suffix", ["missing_fn", "C.missing_attr", "Missing.attr"])
def test_missing_target_raises_naming_it(mods, suffix):
    reg = PatchRegistry("t")
    target = f"{mods.a.__name__}:{suffix}"
    reg.register(f"{mods.a.__name__}:f", "present")(_replacement_f)
    reg.register(target, "absent")(lambda *a: None)
    with pytest.raises(PatchTargetError) as exc:
        reg.apply()
    assert target in str(exc.value)
    # resolved first: nothing half-applied
    assert mods.a.f is mods.f and mods.b.f is mods.f
    assert not reg.applied


def test_missing_module_raises_naming_it():
    reg = PatchRegistry("t")
    target = f"_mstp_no_such_module_{uuid.uuid4().hex[:8]}:f"
    reg.register(target, "absent")(lambda: None)
    with pytest.raises(PatchTargetError) as exc:
        reg.apply()
    assert target in str(exc.value)


@pytest.mark.parametrize("optional", [False, True])
def test_failed_import_inside_the_target_module_is_named(tmp_path, monkeypatch, optional):
    """A target module that exists but imports a missing package (megatron-core >= 0.18 without
    triton): the error names that import, not the target, and an optional patch is not skipped."""
    tag = uuid.uuid4().hex[:8]
    (tmp_path / f"_mstp_imports_missing_{tag}.py").write_text(f"import _mstp_absent_dep_{tag}\ndef f():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = PatchRegistry("t")
    reg.register(f"_mstp_imports_missing_{tag}:f", "t", optional=optional)(lambda: None)
    with pytest.raises(PatchImportError) as exc:
        reg.apply()
    assert f"_mstp_absent_dep_{tag}" in str(exc.value)
    assert "does not exist" not in str(exc.value)


def test_optional_missing_target_is_skipped(mods):
    reg = PatchRegistry("t")
    reg.register(f"{mods.a.__name__}:does_not_exist", "version-specific", optional=True)(lambda: None)
    reg.register(f"{mods.a.__name__}:f", "present")(_replacement_f)
    active = reg.apply()
    assert [p.target for p in active] == [f"{mods.a.__name__}:f"]
    assert not reg.patches[0].applied
    assert not hasattr(mods.a, "does_not_exist")
    assert mods.a.f is _replacement_f and mods.b.f is _replacement_f
    reg.revert()
    assert mods.a.f is mods.f and mods.b.f is mods.f


def test_registering_a_target_twice_is_an_error():
    reg = PatchRegistry("t")
    reg.add(Patch(target="x:y", replacement=lambda: None, reason="r"))
    with pytest.raises(ValueError):
        reg.add(Patch(target="x:y", replacement=lambda: None, reason="r2"))


def test_target_without_attribute_is_rejected():
    reg = PatchRegistry("t")
    reg.register("os.path", "no colon")(lambda: None)
    with pytest.raises(ValueError):
        reg.apply()


# --------------------------------------------------------------------------- real megatron-core


def test_enable_disable_real_megatron():
    import mindspeed_tp
    from mindspeed_tp import state
    from mindspeed_tp.devices import cpu_shims
    from mindspeed_tp.patches import registry
    from mindspeed_tp.patches import tensor_parallel as tp_patches

    import megatron.core.tensor_parallel as mtp
    import megatron.core.tensor_parallel.cross_entropy as mce
    import megatron.core.tensor_parallel.layers as layers

    prior_profile = state._profile if state.enabled() else None
    shims_were_applied = cpu_shims.shim_registry().applied
    mindspeed_tp.disable()  # start from vanilla whatever ran before
    try:
        orig_forward = vars(layers.RowParallelLinear)["forward"]
        orig_col_forward = vars(layers.ColumnParallelLinear)["forward"]
        orig_ce = mtp.vocab_parallel_cross_entropy
        assert orig_ce is mce.vocab_parallel_cross_entropy
        assert orig_forward is not tp_patches.row_parallel_forward
        assert orig_ce is not tp_patches.vocab_parallel_cross_entropy

        mindspeed_tp.enable()
        assert mindspeed_tp.is_enabled()
        assert layers.RowParallelLinear.forward is tp_patches.row_parallel_forward
        assert mtp.vocab_parallel_cross_entropy is tp_patches.vocab_parallel_cross_entropy
        assert mce.vocab_parallel_cross_entropy is tp_patches.vocab_parallel_cross_entropy
        count = sum(p.applied for p in registry().patches)
        assert count >= 5
        col_forward = vars(layers.ColumnParallelLinear)["forward"]
        assert col_forward is not orig_col_forward

        mindspeed_tp.enable()  # twice: same patches, applied once
        assert sum(p.applied for p in registry().patches) == count
        assert vars(layers.ColumnParallelLinear)["forward"] is col_forward  # not wrapped twice
        assert layers.RowParallelLinear.forward is tp_patches.row_parallel_forward
        assert mtp.vocab_parallel_cross_entropy is tp_patches.vocab_parallel_cross_entropy

        mindspeed_tp.disable()
        assert not mindspeed_tp.is_enabled()
        assert not registry().applied
        assert vars(layers.RowParallelLinear)["forward"] is orig_forward
        assert vars(layers.ColumnParallelLinear)["forward"] is orig_col_forward
        assert mtp.vocab_parallel_cross_entropy is orig_ce
        assert mce.vocab_parallel_cross_entropy is orig_ce
    finally:
        mindspeed_tp.disable()
        if prior_profile is not None:
            mindspeed_tp.enable(prior_profile)
        elif not shims_were_applied:
            cpu_shims.remove_shims(*cpu_shims.GROUPS)


def test_revert_restores_modules_imported_while_applied(mods):
    """A module imported while patched binds the patched function by name; revert must restore
    it too, or a 'vanilla' run after disable() would silently keep the patch."""
    reg = PatchRegistry("t")
    reg.register(f"{mods.a.__name__}:f", "test")(_replacement_f)
    reg.apply()
    late = types.ModuleType(f"late_{uuid.uuid4().hex}")
    late.f = mods.a.f  # `from a import f` after apply()
    sys.modules[late.__name__] = late
    try:
        assert late.f is _replacement_f
        reg.revert()
        assert late.f is mods.f and mods.a.f is mods.f and mods.b.f is mods.f
    finally:
        sys.modules.pop(late.__name__, None)


def test_revert_of_an_inherited_attribute_uncovers_the_base(mods):
    class Sub(mods.C):
        pass

    mods.a.Sub = Sub
    reg = PatchRegistry("t")
    reg.register(f"{mods.a.__name__}:Sub.method", "test")(lambda self: "new-method")
    reg.apply()
    assert Sub().method() == "new-method" and mods.C().method() == "orig-method"
    reg.revert()
    assert "method" not in vars(Sub)
    assert Sub.method is mods.C.method


def test_a_wrapping_replacement_shows_the_originals_name_and_signature(mods):
    """Code inspecting a patched function (mbridge or verl asking which arguments GPTModel.__init__
    takes) sees the original's signature, not the wrapper's ``*args, **kwargs``."""
    import inspect

    a = mods.a

    def g(x, y=2, *, scale=1.0):
        """g's own docstring."""
        return x

    a.g = g
    reg = PatchRegistry("t")
    reg.register(f"{a.__name__}:g", "wrap", wraps=True)(lambda original: lambda *args, **kwargs: original(*args, **kwargs))
    reg.apply()
    assert a.g is not g and a.g(5) == 5
    assert inspect.signature(a.g) == inspect.signature(g) and a.g.__name__ == "g" and a.g.__doc__ == g.__doc__
    assert a.g.__wrapped__ is g
    reg.revert()
    assert a.g is g


def test_gpt_models_signature_is_megatrons_while_enabled():
    import inspect

    import mindspeed_tp
    from megatron.core.models.gpt.gpt_model import GPTModel

    before = inspect.signature(GPTModel.__init__)
    mindspeed_tp.enable()
    try:
        assert GPTModel.__init__.__wrapped__ is not None
        assert inspect.signature(GPTModel.__init__) == before
    finally:
        mindspeed_tp.disable()
