"""Rollout-layout mode (profile ``reduction: rollout_layout``): training in any TP/SP/EP layout
reproduces an unmodified batch-invariant rollout engine at TP=R bit for bit -- here the reference
model running as that stock engine (R partial GEMMs over K/R rounded to bf16 and added by its
all-reduce; one fp32 log-softmax over the whole vocab). The canonical-tree mode does not."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_grads_match_vanilla, bits_equal, explain, run_cli, run_torchrun, tiered
from mindspeed_tp.errors import ConfigError
from mindspeed_tp.kernels import invariant_linear
from mindspeed_tp.numerics.rollout_layout.engine_math import full_vocab_logprob, rollout_row_parallel
from mindspeed_tp.contract.profile import load_profile, profile_from_dict

DTYPES = [torch.bfloat16, torch.float32]


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


# -- kernels: what the re-laid weights rely on -------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("k,n", [(128, 128), (256, 128), (256, 1024)])
def test_full_k_gemm_on_a_column_slice_equals_those_columns_of_the_full_gemm(dtype, k, n):
    """N invariance: a training rank computing N/T output columns with the full K gets the bits
    the engine gets for those columns from the whole weight (also for K/R partials)."""
    x = _randn(136 * 3, k, seed=1, dtype=dtype)
    w = _randn(n, k, seed=2, dtype=dtype, scale=k ** -0.5)
    full = invariant_linear(x, w)
    for t in (2, 4):
        cols = n // t
        for r in range(t):
            part = slice(r * cols, (r + 1) * cols)
            assert bits_equal(invariant_linear(x, w[part]), full[:, part]), (t, r)
    for rollout_tp in (2, 4):  # a K/R partial (strided slice of x) on a column block
        kr = k // rollout_tp
        xs, ws = x[:, kr:2 * kr], w[:, kr:2 * kr]
        assert bits_equal(invariant_linear(xs, ws[: n // 2]), invariant_linear(xs, ws)[:, : n // 2])


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_rollout_row_parallel_semantics(dtype):
    prof1, prof2 = load_profile("rollout-tp1"), load_profile("rollout-tp2")
    x = _randn(40, 256, seed=3, dtype=dtype)
    w = _randn(96, 256, seed=4, dtype=dtype, scale=1 / 16)
    assert bits_equal(rollout_row_parallel(x, w, prof1, dtype), invariant_linear(x, w))
    p0 = invariant_linear(x[:, :128], w[:, :128])  # each engine rank's partial, rounded to dtype
    p1 = invariant_linear(x[:, 128:], w[:, 128:])
    two = rollout_row_parallel(x, w, prof2, dtype)
    assert bits_equal(two, (p0.float() + p1.float()).to(dtype))
    if dtype == torch.bfloat16:
        assert not bits_equal(two, invariant_linear(x, w))  # R really changes the bits
    assert bits_equal(rollout_row_parallel(x, w[32:64], prof2, dtype), two[:, 32:64])


def test_full_vocab_logprob_is_row_invariant_and_exact():
    logits = _randn(300, 1024, seed=5, scale=3.0)
    logits[:, 1000:] = float("-inf")  # padded vocab columns, as masked before scoring
    target = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(6))
    full = full_vocab_logprob(logits, target)
    for m in (1, 2, 5, 16, 77):
        assert bits_equal(full_vocab_logprob(logits[:m], target[:m]), full[:m]), m
    for i in range(0, 300, 37):  # one token at a time, as an engine samples
        assert bits_equal(full_vocab_logprob(logits[i:i + 1], target[i:i + 1]), full[i:i + 1]), i
    want = torch.log_softmax(logits.double(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(full.double(), want, rtol=0, atol=1e-5)


# -- profiles -----------------------------------------------------------------------------------

def test_bundled_rollout_profiles():
    for r in (1, 2):
        p = load_profile(f"rollout-tp{r}")
        assert p.rollout_layout and p.rollout_tp == r and p.reduction == "rollout_layout"
        assert p.attention_split_size is None  # num_splits=1
    assert not load_profile().rollout_layout and load_profile().rollout_tp is None


@pytest.mark.parametrize("data, field", [
    ({"reduction": "rollout_layout"}, "rollout_tp"),
    ({"reduction": "rollout_layout", "rollout_tp": 3}, "rollout_tp"),
    ({"reduction": "rollout_layout", "rollout_tp": 0}, "rollout_tp"),
    ({"rollout_tp": 2}, "rollout_tp"),  # set without the mode
    ({"reduction": "rollout_layout", "rollout_tp": 2, "rollout_allreduce_dtype": "bfloat16"}, "rollout_allreduce_dtype"),
    ({"reduction": "rollout_layout", "rollout_tp": 2, "rollout_partial_dtype": "fp16"}, "rollout_partial_dtype"),
    ({"reduction": "rollout_layout", "rollout_tp": 2, "rollout_allreduce_order": "ring"}, "rollout_allreduce_order"),
    ({"reduction": "rollout_layout", "rollout_tp": 2, "rollout_moe_expert_reduce": "after_combine"},
     "rollout_moe_expert_reduce"),
])
def test_bad_rollout_fields_name_the_field(data, field):
    with pytest.raises(ConfigError, match=field):
        profile_from_dict(data)


def test_rollout_tp_must_divide_k():
    with pytest.raises(ConfigError, match="rollout_tp=4"):
        profile_from_dict({"reduction": "rollout_layout", "rollout_tp": 4}).check_rollout_k(6, "ffn_hidden_size")


# -- real megatron-core, world 4: one launch per model covers every layout and both profiles ---

MODELS = {
    "tiny-dense": ("tp1,tp2,tp2-sp,tp4,tp4-sp,tp2-sp-pp2", "tp2-sp"),
    "tiny-moe": ("tp1,tp1-ep2,tp2-sp-ep2,tp4-sp-ep2,tp2-sp-ep2-etp2", "tp2-sp-ep2-etp2"),
}


@pytest.fixture(scope="module", params=tiered(
    "test_rollout_layout.py: torchrun launches (model)", ["tiny-dense"], sorted(MODELS),
    "the rollout-layout mode's GEMMs, logprob and relaid caches at every TP in the dense launch; the MoE "
    "model's expert-TP relayout end to end: test_checker_selects_the_mode_from_the_profile (tiny-moe-shared, "
    "rollout-tp2, tp2-sp-ep2)"))
def run(request, tmp_path_factory):
    layouts, grad_layout = MODELS[request.param]
    prefix = tmp_path_factory.mktemp("rollout-layout") / request.param
    proc = run_torchrun("rollout_layout.py", 4, str(prefix), request.param, layouts, grad_layout)
    assert proc.returncode == 0, explain(proc)
    logprobs = load_file(f"{prefix}.logprobs.safetensors")
    grads = [load_file(f"{prefix}.grads.rank{r}.safetensors") for r in range(4)]
    return request.param, layouts.split(","), logprobs, grads


def test_every_layout_reproduces_the_stock_engine_at_rollout_tp_1_and_2(run):
    model, layouts, t, _ = run
    for r in (1, 2):
        engine = t[f"engine/rollout-tp{r}"]
        for layout in layouts:
            assert bits_equal(t[f"nograd/rollout-tp{r}/{layout}"], engine), (model, r, layout, "no_grad")
            if "pp" not in layout:
                assert bits_equal(t[f"grad/rollout-tp{r}/{layout}"], engine), (model, r, layout, "grad")
    scored = t["scored"]
    assert not bits_equal(t["engine/rollout-tp1"][scored], t["engine/rollout-tp2"][scored])  # R matters


def test_canonical_tree_mode_does_not_match_a_stock_tp1_engine(run):
    model, _, t, _ = run
    scored = t["scored"]
    engine = t["engine/rollout-tp1"][scored]
    for key in sorted(k for k in t if k.startswith("tree/")):
        ours = t[key][scored]
        diff = (ours.double() - engine.double()).abs()
        print(f"{model} canonical_tree {key[5:]} vs stock engine TP=1: max|dlogp|={diff.max():.3e} "
              f"mean|dlogp|={diff.mean():.3e} bitwise={(ours == engine).double().mean() * 100:.1f}% "
              f"of {engine.numel()} tokens")
        assert not bits_equal(ours, engine), key


@pytest.mark.parametrize("mode", ["rollout", "tree"])
def test_gradients_match_vanilla_within_fp32_roundoff(run, mode):
    """Rollout-layout (R=2) and canonical-tree gradients, e.g. tiny-moe with expert-TP=2, where only
    one expert-TP rank's copy of an expert output goes back to the token."""
    model, _, _, grads = run
    for t in grads:
        assert_grads_match_vanilla(t, mode, model)


def test_relaid_weight_cache_follows_the_weights(run):
    model, _, _, grads = run
    for t in grads:
        before, after_step, after_step_uncached, stale, fresh, edit_uncached = t["cache/losses"]
        assert t["cache/bytes"].item() > 0  # training TP=2: row-parallel weights were re-laid and cached
        assert not bits_equal(before, after_step)
        assert bits_equal(after_step, after_step_uncached), "optimizer step did not refresh the cache"
        assert not bits_equal(stale, edit_uncached), "a .data edit without invalidation should leave it stale"
        assert bits_equal(fresh, edit_uncached), "invalidate_relaid_weights() did not refresh the cache"
        assert int(t["cache/stale_refused"]) == 1, "the check mode did not refuse a stale cached weight"
        loaded, loaded_uncached = t["cache/loaded"]
        assert bits_equal(loaded, loaded_uncached), "load_state_dict did not refresh the cache"


def test_checker_selects_the_mode_from_the_profile(tmp_path):
    """The checker's own rollouts (paged KV, chunked prefill, decode) from the stock engine at TP=2,
    scored by MoE training at TP=2/SP/EP=2 (world 2); DeepSeek-style model: sigmoid router, shared
    expert (a megatron RowParallelLinear), dense first layer."""
    proc = run_cli("check", "--model", "tiny-moe-shared", "--profile", "rollout-tp2", "--layouts", "tp2-sp-ep2",
                   "--dtype", "bf16", "--rollout", "3", "--temperature", "0.7", "--max-new-tokens", "8",
                   "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, explain(proc)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["reduction"] == "rollout_layout" and report["rollout_tp"] == 2
    assert report["reference"] == "rollout engine" and report["bitwise_equal_fraction"] == 1.0
    assert report["tokens"] == 3 * 8
