"""The checkers' terminal holds the progress bar and the result, not megatron-core's or torch's
warnings: the workers record them (mindspeed_tp/check/library_warnings.py), the launcher puts them in
the JSON report and a log file it names, and ``-v`` lists each once. mindspeed-tp's own warnings
still print, once; ``enable()`` changes no warning setting."""
import json
import os
import re
import textwrap
import warnings
from argparse import Namespace

import pytest

from conftest import explain, run_cli, run_python
from mindspeed_tp.check import library_warnings

# What Python prints for a warning: "file:line: SomeWarning: text" and the "  warnings.warn(" echo.
WARNING_LINE = re.compile(r"\w*Warning: |warnings\.warn\(|site-packages/(megatron|torch)/")
LISTING = "library warnings ("


@pytest.fixture(scope="module")
def verbose_check(tmp_path_factory):
    """One 2-rank ``check -v`` (its log file in a directory of its own): (process, JSON report, log dir)."""
    tmp = tmp_path_factory.mktemp("quiet")
    logs = tmp / "logs"
    logs.mkdir()
    path = tmp / "report.json"
    proc = run_cli("check", "--tp", "2", "--seq-length", "64", "-v", "--json", str(path), env={"TMPDIR": str(logs)})
    assert proc.returncode == 0 and path.exists(), explain(proc)
    return proc, json.loads(path.read_text()), logs


def test_no_library_warning_before_the_listing_and_the_result_is_there(verbose_check):
    proc, report, _ = verbose_check
    assert "RESULT: bitwise equal" in proc.stdout and "layout" in proc.stdout.splitlines()[1]
    before, listing, _ = proc.stderr.partition(LISTING)
    assert listing, explain(proc)
    noisy = [line for line in (proc.stdout + before).splitlines() if WARNING_LINE.search(line)]
    assert not noisy, explain(proc)
    assert "check [" in before and "done" in before  # the progress bar is still there


def test_verbose_lists_each_distinct_warning_once_and_the_json_and_log_hold_them(verbose_check):
    proc, report, logs = verbose_check
    found = report["warnings"]
    assert any("megatron" in w["source"] for w in found)  # CPU: no Apex, no Transformer Engine
    assert all(1 <= w["processes"] <= 2 and w["category"].endswith("Warning") and w["message"] for w in found)
    assert len({(w["category"], w["message"], w["source"]) for w in found}) == len(found)
    everything = proc.stdout + proc.stderr
    for w in found:
        assert everything.count(f"{w['source']}: {w['category']}: {w['message']}") == 1, explain(proc)
    listed = proc.stderr.split(LISTING, 1)[1].splitlines()
    assert sum(line.startswith("  [") for line in listed) == len(found)
    (log,) = logs.glob("mindspeed-tp-warnings-*.log")
    assert f"also in {log}" in proc.stderr
    assert len(log.read_text().splitlines()) == len(found)


def _rank_file(directory, pid, rank, records):
    with open(os.path.join(directory, f"warnings.{pid}.json"), "w") as f:
        json.dump({"rank": rank, "warnings": records}, f)


def test_recorder_keeps_each_distinct_warning_once(tmp_path):
    recorder = library_warnings.Recorder(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = recorder
        for _ in range(3):
            warnings.warn("Apex is not installed", UserWarning)
        warnings.warn("mindspeed-tp: act on this", RuntimeWarning)
    (name,) = os.listdir(tmp_path)
    saved = json.loads((tmp_path / name).read_text())["warnings"]
    assert [(w["category"], w["message"]) for w in saved] == [("UserWarning", "Apex is not installed"),
                                                             ("RuntimeWarning", "mindspeed-tp: act on this")]
    assert saved[0]["source"].startswith(__file__)


def test_recorded_launcher_records_library_warnings_shows_ours_and_restores(tmp_path, monkeypatch):
    monkeypatch.setattr(library_warnings.tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(library_warnings.ENV, raising=False)
    displayed = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = shown = lambda message, *rest: displayed.append(str(message))  # Python's display
        with library_warnings.recorded() as directory:
            assert os.environ[library_warnings.ENV] == directory  # what the torchrun workers inherit
            warnings.warn("Transformer Engine is not installed", UserWarning)
            warnings.warn("mindspeed-tp: act on this", RuntimeWarning)
            found = library_warnings.collect(directory)
        assert warnings.showwarning is shown and library_warnings.ENV not in os.environ
    assert [w["message"] for w in found] == ["Transformer Engine is not installed"]
    assert displayed == ["mindspeed-tp: act on this"]


def test_report_hides_library_warnings_prints_ours_once_and_fills_the_json(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "run"
    runs.mkdir()
    lib = {"category": "UserWarning", "message": "Apex is not installed", "source": "backends.py:21"}
    own = {"category": "RuntimeWarning", "message": "mindspeed-tp: no C compiler", "source": "host.py:9"}
    _rank_file(runs, 11, "0", [lib, own])
    _rank_file(runs, 12, "1", [own])
    (runs / "status.0").write_text("{}")  # not a warnings file
    assert library_warnings.collect(str(runs)) == [dict(own, processes=2), dict(lib, processes=1)]
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"all_bitwise_equal": True}))
    monkeypatch.setattr(library_warnings.tempfile, "tempdir", str(tmp_path))  # where the log goes
    library_warnings.report(str(runs), Namespace(json=str(report), verbose=False), "mindspeed-tp check", True)
    out, err = capsys.readouterr()
    assert out == "" and err.count("mindspeed-tp: no C compiler") == 1 and "Apex" not in err
    (log,) = tmp_path.glob("mindspeed-tp-warnings-*.log")
    assert err.endswith(f"1 library warning(s) hidden (-v lists them): {log}\n")
    assert "Apex is not installed" in log.read_text()
    assert json.loads(report.read_text())["warnings"] == [dict(own, processes=2), dict(lib, processes=1)]


def test_report_leaves_a_json_the_run_did_not_write(tmp_path, capsys):
    _rank_file(tmp_path, 11, "0", [{"category": "UserWarning", "message": "mindspeed-tp: x", "source": "a.py:1"}])
    stale = tmp_path / "old.json"
    stale.write_text("{}")
    library_warnings.report(str(tmp_path), Namespace(json=str(stale), verbose=True), "mindspeed-tp check", False)
    assert stale.read_text() == "{}"
    assert capsys.readouterr().err == "UserWarning: mindspeed-tp: x\n"  # no library warning: no log, no listing


def test_enable_and_importing_the_checker_change_no_warning_setting():
    code = textwrap.dedent("""
        import warnings
        import megatron.core, torch  # their imports add filters of their own (numpy, sympy)
        before = (list(warnings.filters), warnings.showwarning)
        import mindspeed_tp, mindspeed_tp.check
        mindspeed_tp.enable()
        print("SAME", before == (list(warnings.filters), warnings.showwarning))
    """)
    proc = run_python(code)
    assert proc.returncode == 0 and "SAME True" in proc.stdout, explain(proc)


def test_a_benchmark_under_the_users_torchrun_records_and_lists_on_rank_0(tmp_path, capsys, monkeypatch):
    """benchmarks/module_shares.py and gpu_bench.py, run by the user's own torchrun, record from their
    first import (``record_this_run``: one directory per torchrun run id) and report after the run."""
    monkeypatch.setattr(library_warnings.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run42")
    monkeypatch.delenv(library_warnings.ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        directory = library_warnings.record_this_run()
        assert directory == str(tmp_path / "mindspeed-tp-warnings-run42")
        warnings.warn("Apex is not installed", UserWarning)
        library_warnings.report_after_run(True, "module_shares")
    out, err = capsys.readouterr()
    assert out == "" and err.count("Apex is not installed") == 1 and "library warnings (1, once each)" in err
    before, _, _ = err.partition("library warnings (")
    assert "Apex" not in before
