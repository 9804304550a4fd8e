"""verl's own trainer end to end (issue #58): ``scripts/verl_e2e.sh`` runs unmodified ``python -m
verl.trainer.main_ppo`` (GRPO, Ray, the Megatron actor, the real vLLM at engine TP 1, T 0.8 / top-p 0.95),
and verl's own metrics, read from its file logger's JSONL, judge the rollout / training mismatch: with
mindspeed-tp none at any step, at actor TP 2 and at PP 2 (padded batches) and at TP 2 packed (verl's
``use_remove_padding``); on plain megatron-core (``--vanilla``, padded) some.
The update must move the policy (non-zero rewards and gradients), else the later steps would only repeat
the first one's weights. Full tier only: about 2.5 minutes a run on a 2-core host."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, full_tier

STEPS = 3
E2E = full_tier(
    covered_by="tests/test_verl_rollout_match.py::test_verls_defaults_are_refused_and_the_recipe_is_accepted",
    why="four Ray jobs of verl's trainer (about 10 minutes); the CI tier tests the plugin's parts against verl's own "
        "config and batch code, and the engine-scoring forward against vLLM in test_vllm_sampling.py")


def run_e2e(tmp_path, *flags):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "verl_e2e.sh"), str(out), "--steps", str(STEPS),
                           *flags], env=env, capture_output=True, text=True, timeout=1500)
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "stop", "--force"], capture_output=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = [s.get("data", s) for s in steps]
    assert len(metrics) == STEPS, metrics
    return metrics


MISMATCH = ("training/rollout_probs_diff_max", "rollout_corr/k3_kl")


@E2E
@pytest.mark.parametrize("layout", [[], ["--pp2"], ["--thd"]], ids=["tp2", "pp2", "tp2-thd"])
def test_with_mindspeed_tp_verls_rollout_and_training_logprobs_are_equal_at_every_step(tmp_path, layout):
    metrics = run_e2e(tmp_path, *layout)
    for step, m in enumerate(metrics, 1):
        assert [m[k] for k in MISMATCH] == [0.0, 0.0], (step, {k: m[k] for k in MISMATCH})
        # diff_max == 0 (no NaN): the two probability vectors are the same bits; verl's torch.corrcoef of two
        # identical fp32 rows is 1 up to its own rounding (measured: 1.0, and 1 - 2^-23 in one step)
        assert m["training/rollout_actor_probs_pearson_corr"] >= 1.0 - 2.0 ** -22, step
    assert any(m["actor/grad_norm"] > 0 for m in metrics), "the update never moved the policy"
    assert len({m["critic/score/mean"] for m in metrics}) > 1 or metrics[0]["critic/score/mean"] > 0


@E2E
def test_on_plain_megatron_core_verl_reports_the_mismatch(tmp_path):
    metrics = run_e2e(tmp_path, "--vanilla")
    for step, m in enumerate(metrics, 1):
        assert all(m[k] > 0 for k in MISMATCH), (step, {k: m[k] for k in MISMATCH})
        assert m["training/rollout_actor_probs_pearson_corr"] < 1.0, step
