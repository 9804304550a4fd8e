"""The two test tiers (scripts/test.sh, scripts/test.sh --full): docs/TESTS.md is generated from the
tests' marks; the CI tier is the full tier less exactly the tests marked `full_tier`, each naming a
CI-tier test of the same rule; every rule of docs/CONTRACT.md and every refusal group keeps a CI-tier
test. The collections run in fresh interpreters (scripts/tests_doc.py --json), once per tier."""
import functools
import importlib.util
import os

import pytest

from conftest import ROOT
from test_contract_doc import citations, contract_rows

_spec = importlib.util.spec_from_file_location("tests_doc", os.path.join(ROOT, "scripts", "tests_doc.py"))
tests_doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tests_doc)


@functools.lru_cache(maxsize=None)
def collected(tier):
    return tests_doc._collect_in_subprocess(tier)


def test_the_tests_page_is_generated_from_the_marks():
    with open(tests_doc.PAGE) as f:
        page = f.read()
    assert page == tests_doc.render(collected("full"), collected("ci")), "regenerate: python scripts/tests_doc.py"


def test_the_tiers_are_consistent_and_every_left_out_test_is_covered():
    assert tests_doc.problems(collected("full"), collected("ci")) == []


def test_the_ci_tier_is_the_full_tier_less_the_marked_tests_and_matrix_cases():
    full, ci = collected("full"), collected("ci")
    marked = {n for n, m in full["tests"].items() if m}
    assert marked, "no test is left to the full tier: the tiers are the same"
    assert marked.isdisjoint(ci["tests"])
    assert set(ci["tests"]) <= set(full["tests"])
    assert full["matrices"] == ci["matrices"]  # the same declarations, whichever tier collected them
    assert any(len(ci_cases) < len(full_cases) for ci_cases, full_cases, _ in full["matrices"].values())


def _cited(test_file, name, prefix, node_ids) -> bool:
    """Whether a contract citation (a file, a test, or ``name*``: every test named so) selects a node."""
    if f"tests/{test_file}" in tests_doc.ENGINE_TEST_FILES:
        return True  # collected in .venv-vllm only; the engine phase runs them whole in both tiers
    if prefix:
        return any(n.startswith(f"tests/{test_file}::{name}") for n in node_ids)
    return bool(tests_doc._selects(f"tests/{test_file}" + (f"::{name}" if name else ""), node_ids))


def test_every_contract_rule_has_a_ci_tier_test():
    ci_ids = collected("ci")["tests"]
    uncovered = []
    for row in contract_rows():
        tests = [(f, n, prefix) for kind, _, f, n, prefix in citations(row) if kind == "test" and f]
        if not tests:
            continue  # a table header or a row citing no test (test_contract_doc checks the citations)
        if not any(_cited(f, n, prefix, ci_ids) for f, n, prefix in tests):
            uncovered.append(row[:100])
    assert uncovered == []


def test_a_marked_test_is_left_out_of_the_ci_tier_only(pytester, monkeypatch):
    """The mechanism on a tiny suite of its own: the mark deselects in the CI tier, nothing else does."""
    pytester.copy_example(os.path.join(ROOT, "tests", "conftest.py"))
    pytester.makepyfile(test_sample="""
        import pytest
        from conftest import full_tier, tiered
        CASES = tiered("sample", [1], [1, 2, 3], "why")
        @full_tier(covered_by="tests/test_sample.py::test_kept", why="sample")
        def test_left_out():
            pass
        def test_kept():
            pass
        @pytest.mark.parametrize("case", CASES)
        def test_case(case):
            pass
    """)
    for tier, expected in (("ci", 2), ("full", 5)):
        monkeypatch.setenv("MINDSPEED_TP_TEST_TIER", tier)
        result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
        result.assert_outcomes(passed=expected, deselected=1 if tier == "ci" else 0)
    monkeypatch.setenv("MINDSPEED_TP_TEST_TIER", "fast")
    assert pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider").ret != 0


def test_the_slowest_tests_are_read_from_every_junit_file(tmp_path):
    """scripts/test.sh names the CI tier's ten slowest tests from its pytest calls' JUnit files (a call
    that died before writing its file is passed over)."""
    _spec = importlib.util.spec_from_file_location("slowest_tests", os.path.join(ROOT, "scripts", "slowest_tests.py"))
    slowest_tests = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(slowest_tests)
    (tmp_path / "a.xml").write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="test_x" '
                                    'time="3.5"/><testcase classname="tests.test_a" name="test_y" time="0.2"/>'
                                    '</testsuite></testsuites>')
    (tmp_path / "b.xml").write_text('<testsuite><testcase classname="tests.test_b" name="test_z" time="9"/></testsuite>')
    (tmp_path / "c.xml").write_text("")  # an interrupted call
    files = [str(tmp_path / n) for n in ("a.xml", "b.xml", "c.xml")]
    assert slowest_tests.slowest(files, 2) == [(9.0, "tests.test_b::test_z"), (3.5, "tests.test_a::test_x")]
