"""Report files: JSON keeps its keys and gains new ones, Markdown, the PNG plot, NaN/inf located
instead of hidden in a max, atomic writes, rank-0 progress on stderr."""
import json
import os

from conftest import explain, run_cli, run_python

OLD_KEYS = {"max_abs_logdiff", "mean_abs_logdiff", "bitwise_equal_fraction", "max_abs_probdiff", "pearson", "tokens",
            "nonfinite_values", "layout", "profile", "profile_digest", "reduction", "vanilla",
            "megatron_core_version", "model", "dtype", "seed"}


def test_json_markdown_plot_and_nan_report(tmp_path):
    """One NaN logit is injected (test-only MINDSPEED_TP_TEST_FAULT) at batch row 1, position 5 of
    the TP=2 run: it is counted and located in logits and logprobs, and the distances stay finite."""
    paths = {k: str(tmp_path / "out" / f"report.{k}") for k in ("json", "md", "png")}
    proc = run_cli("check", "--tp", "2", "--seq-length", "64", "--json", paths["json"], "--report-md", paths["md"],
                   "--plot", paths["png"], env={"MINDSPEED_TP_TEST_FAULT": "nan-logits:1:5"})
    assert proc.returncode == 1, explain(proc)
    report = json.loads(open(paths["json"]).read())
    assert OLD_KEYS <= set(report) and report["results"][0]["layout"]["name"] == "tp2"
    assert report["logits_nonfinite"] == 1 and report["logits_first_nonfinite"] == [1, 5]
    assert report["nonfinite_test"] == 1 and report["nonfinite_reference"] == 0
    assert report["first_nonfinite"] == [1, 5]
    assert report["max_abs_logdiff"] == 0.0  # every finite token is still bitwise equal
    assert report["bitwise_equal_fraction"] < 1.0
    first = report["bisect"]["first_divergence"]  # --plot implies --bisect
    assert first["module"] == "logprob" and first["first_token"] == [1, 5]
    assert "NaN/inf logprobs, first at batch/position [1, 5]" in proc.stdout
    md = open(paths["md"]).read()
    assert "| tp2 | mindspeed-tp |" in md and "## Bisect: tp2 (mindspeed-tp)" in md and "`logprob`" in md
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path / "out")) == ["report.json", "report.md", "report.png"]  # no temp files
    assert "check [" in proc.stderr and "done" in proc.stderr  # rank-0 progress


def test_plot_without_matplotlib_names_the_extra():
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from mindspeed_tp.cli import main\n"
            "sys.exit(main(['check', '--plot', 'x.png']))")
    proc = run_python(code)
    assert proc.returncode == 2, explain(proc)
    assert "pip install mindspeed-tp[plot]" in proc.stderr


def test_atomic_writers_replace_and_leave_no_temp(tmp_path):
    from mindspeed_tp.check.report import write_json_atomic, write_text_atomic

    path = tmp_path / "r.json"
    path.write_text("old")
    write_json_atomic(str(path), {"b": 1, "a": 2})
    assert json.loads(path.read_text()) == {"a": 2, "b": 1}
    write_text_atomic(str(tmp_path / "r.md"), "# hi\n")
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r.md"]


def test_an_empty_scored_mask_is_refused_and_never_reads_as_a_pass():
    """Issue #43, item 9: zero scored tokens gave fraction 1.0 and exit 0."""
    import pytest
    import torch

    from mindspeed_tp import ConfigError
    from mindspeed_tp.check.metrics import compare_logprobs, require_scored

    none = torch.zeros(2, 4, dtype=torch.bool)
    r = compare_logprobs(torch.zeros(2, 4), torch.zeros(2, 4), none)
    assert r["tokens"] == 0 and not r["bitwise_equal_fraction"] == 1.0
    with pytest.raises(ConfigError, match="no token is scored"):
        require_scored(none, "the checked batch")
    require_scored(~none, "the checked batch")
