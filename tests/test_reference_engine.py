"""The reference rollout engine: same weights and RoPE as Megatron, and batch invariance -- a
request's tokens and logprobs do not depend on the other requests, their number, its position,
when it joined, the page size, or how its prompt was chunked."""

import pytest
import torch

from mindspeed_tp.models.spec import load_model_spec
from mindspeed_tp.contract.profile import Profile, load_profile
from mindspeed_tp.reference import ReferenceEngine, ReferenceModel, Request

from conftest import bits_equal, explain, full_tier, run_python

SHAPES_CODE = """
import torch, mindspeed_tp
from mindspeed_tp.check.driver import init_distributed, setup_parallel_state
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.check.builder import build_gpt_stage
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.spec import load_model_spec
from mindspeed_tp.models.weights import full_weight_shapes
from mindspeed_tp.kernels import rope_inv_freq
from mindspeed_tp.check.metrics import same_bits
from mindspeed_tp.contract.profile import load_profile
init_distributed(); install_cpu_shims(); mindspeed_tp.enable()
prof = load_profile()
for name in ("tiny-dense", "tiny-moe", "tiny-moe-shared"):
    spec = load_model_spec(name)
    setup_parallel_state(Layout(), 0)
    model = build_gpt_stage(spec, Layout(), torch.float32, prof)
    got = {k: tuple(v.shape) for k, v in model.named_parameters()}
    got.update({k: tuple(v.shape) for k, v in model.named_buffers() if k.endswith("expert_bias")})
    want = full_weight_shapes(spec, spec.padded_vocab(prof))
    print(name, "SHAPES", got == want, sorted(set(got) ^ set(want))[:4])
    rope = model.rotary_pos_emb.inv_freq
    print(name, "ROPE", same_bits(rope, rope_inv_freq(spec.kv_channels, int(spec.rotary_base))))
"""


def test_engine_weights_and_rope_match_megatron_tp1():
    proc = run_python(SHAPES_CODE)
    assert proc.returncode == 0, explain(proc)
    for name in ("tiny-dense", "tiny-moe", "tiny-moe-shared"):
        assert f"{name} SHAPES True []" in proc.stdout, proc.stdout
        assert f"{name} ROPE True" in proc.stdout, proc.stdout


def _prompts(n, seed=5, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run(model, prompts, target_index, temperature, position=0, arrival=None, **engine_kw):
    """Generate with the target prompt placed at ``position`` among the others; return its result."""
    order = list(range(len(prompts)))
    order.remove(target_index)
    order.insert(position, target_index)
    reqs = [Request(prompt=prompts[i], max_new_tokens=12, request_id=i, temperature=temperature,
                    arrival_step=(arrival or {}).get(i, 0)) for i in order]
    ReferenceEngine(model, seed=11, **engine_kw).generate(reqs)
    (target,) = [r for r in reqs if r.request_id == target_index]
    return torch.tensor(target.output), target.logprob_tensor


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-moe-shared"])
def model(request):
    # Small attention blocks and a split size, so prompts of a few dozen tokens cross blocks/splits.
    prof = Profile(name="small-blocks", attention_block_size=16, attention_split_size=32)
    return ReferenceModel.seeded(load_model_spec(request.param), prof, seed=3, dtype=torch.bfloat16)


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=full_tier(
    covered_by="tests/test_reference_engine.py::test_request_alone_with_one_with_seven_at_any_position",
    why="greedy and sampled requests take the same batched forward; the sampled case (T = 0.7) also draws from "
        "each request's own generator, which a batch-mate could disturb")), 0.7])
def test_request_alone_with_one_with_seven_at_any_position(model, temperature):
    prompts = _prompts(8)
    alone_tokens, alone_lp = _run(model, prompts[:1], 0, temperature)
    assert alone_lp.numel() == 12 and torch.isfinite(alone_lp).all()
    cases = [
        dict(prompts=prompts[:2], position=1),
        dict(prompts=prompts, position=0),
        dict(prompts=prompts, position=7),
        dict(prompts=prompts, position=3, arrival={0: 4, 5: 2}),  # joins late, others leave early
    ]
    for case in cases:
        tokens, lp = _run(model, case["prompts"], 0, temperature, case["position"], case.get("arrival"),
                          max_running=4)
        assert bits_equal(tokens, alone_tokens), case
        assert bits_equal(lp, alone_lp), case


def test_page_size_and_prefill_chunking_do_not_matter(model):
    prompts = _prompts(3, seed=9)
    base_tokens, base_lp = _run(model, prompts, 1, 0.7)
    for kw in (dict(page_size=8), dict(page_size=32), dict(page_size=128), dict(prefill_chunk=5),
               dict(prefill_chunk=1), dict(prefill_chunk=17, page_size=7)):
        tokens, lp = _run(model, prompts, 1, 0.7, **kw)
        assert bits_equal(tokens, base_tokens), kw
        assert bits_equal(lp, base_lp), kw


def test_temperature_sampling_is_seeded_per_request():
    model = ReferenceModel.seeded(load_model_spec("tiny-dense"), load_profile(), seed=3, dtype=torch.float32)
    prompts = _prompts(2)
    a, _ = _run(model, prompts, 0, 1.0)
    b, _ = _run(model, prompts, 0, 1.0)
    assert bits_equal(a, b)
    greedy, _ = _run(model, prompts, 0, 0.0)
    assert not bits_equal(a, greedy)  # temperature 1.0 over ~1000 tokens does not reproduce argmax


def test_split_size_changes_the_arithmetic_but_not_the_agreement():
    """A split-KV profile is a different contract (merges change rounding), so the same model and
    prompt give other bits than without splits -- the profile must be shared by both sides."""
    spec = load_model_spec("tiny-dense")
    prompts = _prompts(1, seed=2)
    prompts[0] = (prompts[0] * 4)[:120]
    outs = []
    for split in (None, 32):
        prof = Profile(name="s", attention_block_size=16, attention_split_size=split)
        model = ReferenceModel.seeded(spec, prof, seed=3, dtype=torch.float32)
        outs.append(_run(model, prompts, 0, 0.0)[1])
    assert not bits_equal(outs[0], outs[1])
    assert torch.allclose(outs[0], outs[1], atol=1e-4)  # semantics unchanged: same math, other rounding
