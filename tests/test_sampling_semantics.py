"""Which logprob of a sampled token is compared (contract/sampling.py: raw, temperature, processed)
and the sampling transforms it goes through (kernels/sampling.py), with the bundled reference engine:
the temperature division is IEEE fp32 division by the temperature (as vLLM's ``apply_temperature``;
never a reciprocal multiply), the top-k / top-p mask is row-local, and ``check`` and ``rl-check``
sample with --temperature/--top-k/--top-p and compare each semantics bitwise in two layouts, vanilla
megatron-core not. The real engine: tests/test_vllm_sampling.py."""
import json

import pytest
import torch

from conftest import bits_equal, explain, full_tier, run_cli, tiered
from mindspeed_tp.contract.profile import Profile, load_profile
from mindspeed_tp.contract.sampling import Sampling, resolve_semantics
from mindspeed_tp.errors import ConfigError
from mindspeed_tp.kernels.sampling import divide_by_temperature, mask_dropped_vocab, top_k_top_p_rows


@pytest.mark.parametrize("temperature", [0.7, 0.8, 0.6, 1.3, 0.9])
def test_the_temperature_division_is_correctly_rounded_fp32_division(temperature):
    """fp32(x / fp32(T)) for every element: computed in double and rounded once, IEEE division's
    result (a multiply by a rounded reciprocal, CUDA's scalar path, differs on some of these)."""
    gen = torch.Generator().manual_seed(int(temperature * 10))
    x = torch.randn(4096, generator=gen) * 8
    t = torch.tensor(temperature, dtype=torch.float32)
    exact = (x.double() / t.double()).float()
    assert bits_equal(divide_by_temperature(x, temperature), exact)
    assert bits_equal(divide_by_temperature(x.bfloat16(), temperature), (x.bfloat16().double() / t.double()).float())
    reciprocal = x * (1.0 / t)
    assert not bits_equal(reciprocal, exact)  # the sweep can tell the two apart
    assert divide_by_temperature(x, 1.0).data_ptr() == x.data_ptr()  # T = 1: the fp32 logits as they are


@pytest.mark.parametrize("vocab", [1000, 151, 4096, 37])
@pytest.mark.parametrize("top_k, top_p", [(20, 1.0), (0, 0.9), (5, 0.8), (0, 1e-4)])
def test_the_top_k_top_p_mask_is_row_local(vocab, top_k, top_p):
    """A row's mask does not depend on the other rows (batch sizes 1..33) or on ties elsewhere."""
    gen = torch.Generator().manual_seed(vocab + top_k)
    rows = (torch.randn(33, vocab, generator=gen) * 3).round(decimals=1) / 0.7  # ties included
    full = top_k_top_p_rows(rows, top_k, top_p)
    for n in (1, 2, 7, 16, 33):
        assert bits_equal(top_k_top_p_rows(rows[:n], top_k, top_p), full[:n])
    for i in (0, 5, 32):
        assert bits_equal(top_k_top_p_rows(rows[i:i + 1].clone(), top_k, top_p), full[i:i + 1])
    kept = torch.isfinite(full)
    assert kept.any(-1).all()
    assert bits_equal(torch.where(kept, full, 0.0), torch.where(kept, rows, 0.0))  # kept values untouched


def test_top_k_keeps_the_k_largest_and_ties_top_p_the_smallest_set_over_p():
    rows = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0]])
    assert torch.isfinite(top_k_top_p_rows(rows, 2, 1.0)).tolist() == [[False, True, False, True, False]]
    assert torch.isfinite(top_k_top_p_rows(rows, 3, 1.0)).tolist() == [[False, True, False, True, True]]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.isfinite(top_k_top_p_rows(probs, 0, 0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_k_top_p_rows(probs, 0, 0.4)).tolist() == [[True, False, False, False]]


def test_a_shard_is_masked_where_the_full_row_is():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 128, generator=gen)
    logits[:, 100:] = float("-inf")  # padded columns beyond the true vocab stay as they are
    masked = mask_dropped_vocab(logits, None, 100, lambda rows: top_k_top_p_rows(rows, 7, 1.0))
    assert bits_equal(masked[:, :100], top_k_top_p_rows(logits[:, :100], 7, 1.0))
    assert torch.isinf(masked[:, 100:]).all()


def test_the_semantics_resolve_flag_then_profile_then_default_and_are_validated():
    assert resolve_semantics("processed", "raw", "temperature") == "processed"
    assert resolve_semantics(None, "raw", "temperature") == "raw"
    assert resolve_semantics(None, None, "temperature") == "temperature"
    assert Sampling(0.7, semantics="raw").scoring_temperature == 1.0
    assert Sampling(0.0, top_p=0.5, semantics="processed").masks is False  # greedy: no cut
    assert Sampling(0.7, top_k=-1, semantics="processed").top_k == 0
    for bad in (dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-1.0), dict(semantics="logits")):
        with pytest.raises(ConfigError):
            Sampling(**bad)
    with pytest.raises(ConfigError, match="logprob_semantics"):
        Profile(logprob_semantics="logits")
    assert "logprob_semantics" not in load_profile("vllm-cpu-tp1").to_dict()  # digests of earlier runs kept
    assert Profile(logprob_semantics="processed").to_dict()["logprob_semantics"] == "processed"


_ALL = [("processed", "top-p"), ("temperature", "top-k"), ("raw", "top-p"), ("processed", "top-k"),
        ("temperature", "top-p"), ("raw", "top-k")]
CASES = tiered("test_sampling_semantics.py: (semantics, cut) check launches", _ALL[:1], _ALL,
               "processed under top-p runs the division, the gathered-row mask and the canonical tree in two layouts; "
               "temperature is every rollout test's default (test_rollout_parity.py at T=0.7), raw the engine "
               "tests' (test_vllm_engine.py), top-k the same mask function (test_the_top_k_top_p_mask_is_row_local "
               "sweeps both cuts; test_vllm_sampling.py runs both against vLLM in the CI tier)")
CUTS = {"top-p": ["--top-p", "0.9"], "top-k": ["--top-k", "20"]}


@pytest.mark.parametrize("semantics, cut", CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_check_compares_each_semantics_bitwise_in_two_layouts(semantics, cut, tmp_path):
    path = tmp_path / "r.json"
    proc = run_cli("check", "--model", "tiny-moe", "--layouts", "tp2-sp-ep2,tp1-ep2", "--rollout", "4",
                   "--temperature", "0.7", *CUTS[cut], "--logprob-semantics", semantics, "--max-new-tokens", "8",
                   "--compare-vanilla", "--json", str(path))
    assert proc.returncode == 0, explain(proc)
    assert f"compared: {semantics} logprobs (T=0.7, {cut} {CUTS[cut][1]})" in proc.stdout
    results = json.loads(path.read_text())["results"]
    ours = [r for r in results if not r["vanilla"]]
    assert len(ours) == 2 and all(r["logprob_semantics"] == semantics for r in results)
    assert all(r["bitwise_equal_fraction"] == 1.0 and r["tokens"] == 32 for r in ours)
    assert all(r["bitwise_equal_fraction"] < 1.0 for r in results if r["vanilla"])


def test_check_refuses_a_cut_without_rollouts():
    proc = run_cli("check", "--top-p", "0.9", timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert "--rollout" in proc.stderr


@full_tier(covered_by="tests/test_sampling_semantics.py::test_check_compares_each_semantics_bitwise_in_two_layouts",
           why="the loop's logprobs go through the same driver call as check's (logprobs_from_logits with the run's "
               "Sampling); rl-check at T != 1 against vLLM runs in the CI tier (test_rl_vllm.py)")
def test_rl_check_processed_logprobs_with_top_p_are_bitwise_every_iteration(tmp_path):
    path = str(tmp_path / "rl.json")
    proc = run_cli("rl-check", "--model", "tiny-dense", "--layout", "tp2-sp", "--iterations", "2", "--prompts", "2",
                   "--group-size", "2", "--temperature", "0.7", "--top-p", "0.9", "--logprob-semantics", "processed",
                   "--json", path)
    assert proc.returncode == 0, explain(proc)
    report = json.load(open(path))
    assert report["sampling"] == {"logprob_semantics": "processed", "temperature": 0.7, "top_k": 0, "top_p": 0.9}
    for r in report["arms"][0]["iterations"]:
        assert r["tokens"] > 0 and r["bitwise_fraction"] == 1.0 and r["step_bitwise_fraction"] == 1.0
