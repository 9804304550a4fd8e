"""The refusal table is the one list of refused settings: docs/REFUSALS.md shows it, every refusal the
code raises is in it, and every entry is raised somewhere."""
import os
import re

from conftest import ROOT

from mindspeed_tp.contract import refusals

PACKAGE = os.path.join(ROOT, "mindspeed_tp")


def _sources():
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(directory, name)) as f:
                    yield f.read()


def test_the_refusals_page_is_the_table_as_generated():
    with open(os.path.join(ROOT, "docs", "REFUSALS.md")) as f:
        page = f.read()
    assert page == refusals.refusals_page(), "regenerate: mindspeed-tp refusals > docs/REFUSALS.md"
    block = page.split(refusals.REFUSALS_PAGE_BEGIN, 1)[1].split(refusals.REFUSALS_PAGE_END, 1)[0].strip()
    assert block == refusals.markdown()


def test_the_readme_links_the_refusals_page_instead_of_copying_it():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "docs/REFUSALS.md" in readme and refusals.REFUSALS_PAGE_BEGIN not in readme


def test_every_raised_refusal_is_in_the_table_and_every_entry_is_used():
    code = "\n".join(_sources())
    raised = set(re.findall(r'refuse\(\s*"(\w+)"', code))
    # the model guard raises its entries through a table of module families / classes
    from mindspeed_tp.patches import models

    raised |= {key for _, key in models._UNCOVERED} | set(models._UNCOVERED_CLASSES.values())
    # the refused config fields' groups, raised through their own message by check_refused_fields
    from mindspeed_tp.contract import config_fields

    raised |= {key for key in config_fields.REFUSED.values() if "{setting}" in refusals.REFUSALS[key].message}
    assert raised - set(refusals.REFUSALS) == set()
    unused = {k for k, r in refusals.REFUSALS.items() if r.attr is None and k not in raised}
    assert unused == set()


def test_config_entries_refuse_by_name():
    import types

    import pytest

    from mindspeed_tp import ConfigError

    config = types.SimpleNamespace(moe_expert_capacity_factor=1.25)
    with pytest.raises(ConfigError, match="moe_expert_capacity_factor=1.25 .*dropless"):
        refusals.check_config(refusals.MOE, config)
    refusals.check_config(refusals.MOE, types.SimpleNamespace(moe_expert_capacity_factor=None, moe_grouped_gemm=False))
    args = types.SimpleNamespace(use_ascend_mc2=True, tp_2d=False)
    assert [flag for flag, _ in refusals.refused_flags(refusals.MINDSPEED, args)] == ["--use-ascend-mc2"]
