"""The numerics strategies (mindspeed_tp/numerics/): every bundled profile resolves to one, the
megatron-core adapters hold no mode or engine branch, an engine registered in one line of
``numerics.ENGINES`` is what the adapters call, with no edit to them, and a mode added as one package
plus one line of ``numerics.MODES`` brings its own patch entries."""
import dataclasses
import os
import re
import sys

import pytest
import torch

from conftest import ROOT, bits_equal

import mindspeed_tp
from mindspeed_tp import numerics, state
from mindspeed_tp.contract.profile import PROFILE_DIR, load_profile
from mindspeed_tp.numerics.canonical.strategy import CanonicalTree

BUNDLED = {"default": "CanonicalTree", "rollout-tp1": "RolloutLayout", "rollout-tp2": "RolloutLayout",
           "vllm-cpu-tp1": "VllmEngine", "vllm-cpu-tp2": "VllmEngine"}


def test_the_table_names_every_bundled_profile():
    assert sorted(n[:-5] for n in os.listdir(PROFILE_DIR) if n.endswith(".yaml")) == sorted(BUNDLED)


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_every_bundled_profile_resolves_to_its_strategy(name):
    assert type(numerics.resolve(load_profile(name))).__name__ == BUNDLED[name]


def test_bitwise_training_is_a_layer_over_the_canonical_tree():
    strategy = numerics.resolve(load_profile("default").replace(bitwise_training=True))
    assert type(strategy).__name__ == "BitwiseTraining" and isinstance(strategy, CanonicalTree)
    assert strategy.backward is not None and CanonicalTree.backward is None


def test_the_adapters_hold_no_mode_or_engine_branch():
    found = []
    directory = os.path.join(ROOT, "mindspeed_tp", "patches")
    for name in sorted(os.listdir(directory)):
        if name.endswith(".py"):
            with open(os.path.join(directory, name)) as f:
                for number, line in enumerate(f, 1):
                    if re.search(r"engine_name|bitwise_training|reduction *==|state\.profile\(|def _vllm", line):
                        found.append(f"patches/{name}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


class Probe(CanonicalTree):
    """An engine registered for the test: its logprob marks what it returns."""

    name = "probe"

    def logprob(self, logits, target, group, vocab_size):
        return torch.full(target.shape, float(vocab_size))


def test_an_engine_registered_in_one_line_is_what_the_adapters_call(monkeypatch):
    from mindspeed_tp.patches.tensor_parallel import vocab_parallel_cross_entropy

    monkeypatch.setitem(numerics.ENGINES, "probe", f"{__name__}:Probe")
    base = load_profile("vllm-cpu-tp1")
    profile = base.replace(engine=dataclasses.replace(base.engine, name="probe"))
    prior = state._profile if state.enabled() else None
    try:
        mindspeed_tp.enable(profile)
        assert type(numerics.ACTIVE.strategy) is Probe
        mindspeed_tp.set_vocab_size(7)
        # a world of one: no process group in this process, or the one-process world some test made
        group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else object()
        loss = vocab_parallel_cross_entropy(torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.long), tp_group=group)
        assert bits_equal(loss, torch.full((2, 3), -7.0))
    finally:
        mindspeed_tp.set_vocab_size(None)
        if prior is not None:
            mindspeed_tp.enable(prior)
        else:
            mindspeed_tp.disable()


def test_a_mode_added_as_one_package_and_one_line_brings_its_strategy_and_patch_entries(tmp_path, monkeypatch):
    from mindspeed_tp import patches

    package = tmp_path / "probe_mode"
    package.mkdir()
    (package / "strategy.py").write_text("from mindspeed_tp.numerics.canonical import CanonicalTree\n\n\n"
                                         "class ProbeMode(CanonicalTree):\n    name = 'probe_mode'\n")
    (package / "patches.py").write_text("def register(reg):\n    reg.register('json:dumps', 'probe_mode: an entry of "
                                        "its own', wraps=True)(lambda original: original)\n")
    (package / "__init__.py").write_text("from .patches import register as register_patches\n"
                                         "from .strategy import ProbeMode\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "probe_mode", raising=False)
    monkeypatch.setitem(numerics.MODES, "probe_mode", "probe_mode:ProbeMode")
    assert numerics.strategy_class("probe_mode").__name__ == "ProbeMode"
    targets = [p.target for p in patches.build_registry().patches]  # the adapters', then each mode's in order
    assert targets == [p.target for p in patches.registry().patches] + ["json:dumps"]
