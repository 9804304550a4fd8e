"""Training equals the rollout: the reference engine generates (paged KV cache, chunked prefill,
decode, continuous batching), then the distributed Megatron forward scores prompt+response; the
response tokens' logprobs are bitwise equal. Vanilla Megatron scoring the same rollouts is not."""
import json

import pytest
import yaml
from safetensors.torch import load_file

from conftest import bits_equal, explain, run_cli, tiered

_ALL_CASES = [
    ("tiny-dense", "tp2-sp,tp2-sp-pp2", "0"),
    ("tiny-dense", "tp2-sp,tp2-sp-pp2", "0.7"),
    ("tiny-moe", "tp2-sp-ep2,tp2-sp-ep2-pp2", "0"),
    ("tiny-moe", "tp2-sp-ep2,tp2-sp-ep2-pp2", "0.7"),
]
CASES = tiered("test_rollout_parity.py: (model, layouts, temperature) launches", [_ALL_CASES[1]], _ALL_CASES,
               "the dense model sampled at TP+SP and with a pipeline; MoE rollouts scored bitwise in the CI tier: "
               "test_gemm_invariance.py::test_shared_experts_in_decode_match_the_rollout_engine (tp2-sp-ep2, "
               "tp2-sp-pp2) and test_hf_checkpoint.py::test_rollout_from_checkpoint_prompts; the engine's decode "
               "and the training forward do not depend on what picks the tokens")


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-T{t}" for m, _, t in CASES])
def rollout(request, tmp_path_factory):
    model, layouts, temperature = request.param
    tmp = tmp_path_factory.mktemp("rollout")
    proc = run_cli("check", "--model", model, "--layouts", layouts, "--dtype", "bf16", "--rollout", "5",
                   "--temperature", temperature, "--max-new-tokens", "12", "--compare-vanilla",
                   "--dump-logprobs", str(tmp), "--json", str(tmp / "r.json"))
    assert proc.returncode == 0, explain(proc)
    return layouts.split(","), load_file(str(tmp / "logprobs.safetensors")), json.loads((tmp / "r.json").read_text())


def test_training_logprobs_equal_the_rollout_engine(rollout):
    layouts, t, report = rollout
    scored = t["scored"]
    assert scored.sum() == 5 * 12
    engine = t["consistent/reference"][scored]
    for layout in layouts:
        assert bits_equal(t[f"consistent/{layout}"][scored], engine), layout
    assert all(r["reference"] == "rollout engine" for r in report["results"])


def test_vanilla_scoring_of_the_same_rollouts_differs(rollout):
    layouts, t, report = rollout
    scored = t["scored"]
    for layout in layouts:
        assert not bits_equal(t[f"vanilla/{layout}"][scored], t["vanilla/reference"][scored]), layout
    assert all(r["max_abs_logdiff"] > 0 for r in report["results"] if r["vanilla"])


def test_small_blocks_and_split_kv_profile(tmp_path):
    """B=16 and split size 32: rollouts of ~50 tokens cross several blocks and splits, in training,
    chunked prefill and decode alike."""
    prof = tmp_path / "small.yaml"
    prof.write_text(yaml.safe_dump({"name": "small-blocks", "attention_block_size": 16, "attention_split_size": 32}))
    proc = run_cli("check", "--profile", str(prof), "--layouts", "tp2-sp,tp1-pp2", "--dtype", "bf16",
                   "--rollout", "4", "--temperature", "0.7", "--max-new-tokens", "20", "--seq-length", "64",
                   "--dump-logprobs", str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    t = load_file(str(tmp_path / "logprobs.safetensors"))
    scored = t["scored"]
    for layout in ("tp2-sp", "tp1-pp2"):
        assert bits_equal(t[f"consistent/{layout}"][scored], t["consistent/reference"][scored]), layout
