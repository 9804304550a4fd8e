"""docs/RESULTS.md is what scripts/results.py renders from the stored reports in docs/results/, every
table on it names the command, the commit and the CPU it came from, and the README holds no measured
table of its own (it links the page). Reads files only: no checker or benchmark is launched."""
import importlib.util
import os

from conftest import ROOT


def _results_module():
    spec = importlib.util.spec_from_file_location("results_script", os.path.join(ROOT, "scripts", "results.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _page() -> str:
    with open(os.path.join(ROOT, "docs", "RESULTS.md")) as f:
        return f.read()


def test_the_results_page_is_the_rendering_of_the_stored_reports():
    results = _results_module()
    assert _page() == results.render(), "regenerate: python scripts/results.py"


def test_every_stored_report_is_known_and_carries_its_provenance():
    results = _results_module()
    records = results.load_records()
    assert records, "docs/results/ holds no report"
    for name, rec in records.items():
        assert rec["name"] == name and name in results.BY_NAME
        assert rec["command"] == results.display_command(results.BY_NAME[name])
        assert len(rec["commit"]) >= 7 and rec["cpu"]["model"] and "torch_capability" in rec["cpu"]
        assert set(rec["cpu"]["isa"]) <= set(results.ISA_FLAGS)
        assert rec["exit_code"] in results.BY_NAME[name].exit_codes
        assert isinstance(rec["report"], dict) and rec["report"]


def test_every_table_names_its_command_commit_and_cpu():
    sections = _page().split("\n## ")[1:]
    tables = 0
    for section in sections:
        lines = section.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):  # a table starts
                tables += 1
                above = "\n".join(lines[:i])
                for label in ("- Command: `", "- Commit: `", "- CPU: "):
                    assert label in above, f"table in section {lines[0]!r} without {label.strip()}"
    assert tables >= 1


def test_every_known_report_is_on_the_page_or_listed_as_not_yet_regenerated():
    results = _results_module()
    page = _page()
    stored = results.load_records()
    for rep in results.REPORTS:
        if rep.name in stored:
            assert f"## {rep.title}\n" in page
        else:
            assert f"--run {rep.name}`" in page.split("## Not yet regenerated", 1)[1]


def test_the_readme_links_the_results_instead_of_copying_tables():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "docs/RESULTS.md" in readme
    for marker in ("max|dlogp|", "max\\|dlogp\\|", "max|Δlogp|", "step time x vanilla", "loss=  logp="):
        assert marker not in readme, f"README holds a measured table ({marker!r}): it belongs in docs/RESULTS.md"

