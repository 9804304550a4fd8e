"""--bisect on real runs with a known, injected divergence (MINDSPEED_TP_TEST_FAULT, test-only:
see tests/support/fault_injection.py): the report must name the module and class it correctly."""
import json

import torch
from safetensors.torch import load_file

from conftest import bits_equal, explain, full_tier, run_cli

FAULT = "MINDSPEED_TP_TEST_FAULT"


def _first(report):
    return report["bisect"]["first_divergence"]


def test_perturbed_weight_is_named_as_kernel_across_tp_sp_pp(tmp_path):
    """Layer 2's fc2 weight differs in the distributed run only (stage 2 of PP=2, TP=2 row shards,
    SP): the bisect must name that module, with equal inputs -> kernel, and dump both tensors."""
    out = tmp_path / "r.json"
    proc = run_cli("check", "--tp", "2", "--sp", "--pp", "2", "--seq-length", "64", "--bisect",
                   "--bisect-dump", str(tmp_path / "dump"), "--json", str(out),
                   env={FAULT: "perturb:decoder.layers.2.mlp.linear_fc2.weight"})
    assert proc.returncode == 1, explain(proc)
    report = json.loads(out.read_text())
    first = _first(report)
    assert first["module"] == "decoder.layers.2.mlp.linear_fc2", first
    assert first["classification"] == "kernel" and first["layer"] == 2
    assert report["bisect"]["layers_affected"] == [2, 3]
    assert first["tokens_differing"] > 0 and first["max_abs_diff"] > 0
    assert "first divergence at decoder.layers.2.mlp.linear_fc2" in proc.stdout
    modules = {m["module"]: m for m in report["bisect"]["modules"]}
    assert modules["decoder.layers.1"]["tokens_differing"] == 0
    assert modules["decoder.layers.1"]["digest"] == modules["decoder.layers.1"]["reference_digest"]
    dump = load_file(report["bisect"]["dump"])
    name = "decoder.layers.2.mlp.linear_fc2"
    assert bits_equal(dump[f"test/{name}/input"], dump[f"reference/{name}/input"])
    assert not bits_equal(dump[f"test/{name}/output"], dump[f"reference/{name}/output"])
    assert bits_equal(dump["test/decoder.layers.1/output"], dump["reference/decoder.layers.1/output"])
    # full shapes, token-major: (batch, seq, hidden) although the run held SP/TP/PP shards
    assert dump[f"test/{name}/output"].shape == (4, 64, 128)


@full_tier(covered_by="tests/test_bisect.py::test_classification_rules",
           why="the framework verdict for inputs that differ is the classification's rule, tested in-process; the "
               "launched bisect runs in test_perturbed_weight_is_named_as_kernel_across_tp_sp_pp")
def test_different_inputs_are_named_as_framework_and_reference_file_keeps_modules(tmp_path):
    """The framework hands layer 1's pre-MLP norm a different input: framework. The same answer
    comes from a reference file saved with --bisect (computed once, shipped)."""
    env = {FAULT: "perturb-input:decoder.layers.1.pre_mlp_layernorm"}
    ref = str(tmp_path / "ref.safetensors")
    for extra in (["--save-reference", ref], ["--reference", ref]):
        out = tmp_path / "r.json"
        proc = run_cli("check", "--tp", "2", "--seq-length", "64", "--bisect", "--json", str(out), *extra, env=env)
        assert proc.returncode == 1, explain(proc)
        first = _first(json.loads(out.read_text()))
        assert first["module"] == "decoder.layers.1.pre_mlp_layernorm", first
        assert first["classification"] == "framework"
        assert "inputs already differ" in first["reason"]


@full_tier(covered_by="tests/test_bisect.py::test_classification_rules",
           why="flipped routing is classified as framework by the same rules, tested in-process")
def test_flipped_routing_is_named_as_framework_moe():
    """A router weight that differs in the EP=2 run flips an expert choice of layer 1: the first
    divergence is the router's decision, classed framework."""
    proc = run_cli("check", "--model", "tiny-moe", "--ep", "2", "--seq-length", "64", "--bisect",
                   env={FAULT: "perturb:decoder.layers.1.mlp.router.weight"})
    assert proc.returncode == 1, explain(proc)
    assert "first divergence at decoder.layers.1.mlp.router" in proc.stdout, explain(proc)
    assert "classification: framework (routing decisions differ" in proc.stdout


def test_rollout_engine_bisect_names_the_module(tmp_path):
    """Against the rollout engine (prefill chunks + decode steps, rows placed by request and
    position): every module before the perturbed QKV weight of layer 1 is bitwise equal (the two
    runs are aligned by module name and token), and that module is named."""
    out = tmp_path / "r.json"
    proc = run_cli("check", "--tp", "2", "--sp", "--rollout", "4", "--max-new-tokens", "8", "--seq-length", "32",
                   "--bisect", "--json", str(out), env={FAULT: "perturb:decoder.layers.1.self_attention.linear_qkv.weight"})
    assert proc.returncode == 1, explain(proc)
    report = json.loads(out.read_text())
    assert report["reference"] == "rollout engine"
    first = report["bisect"]["first_divergence"]
    assert first["module"] == "decoder.layers.1.self_attention.linear_qkv" and first["classification"] == "kernel"
    names = [m["module"] for m in report["bisect"]["modules"]]
    before = report["bisect"]["modules"][: names.index(first["module"])]
    assert [m["module"] for m in before][:2] == ["embedding", "decoder.layers.0.input_layernorm"]
    assert "decoder.layers.0" in [m["module"] for m in before] and names[-1] == "logprob"
    assert all(m["tokens_differing"] == 0 and m["tokens"] > 0 for m in before)


def test_classification_rules():
    """compare_modules on hand-made tensors: equal inputs + different output -> kernel; different
    inputs -> framework; a router map that differs -> framework; NaN counted and located."""
    from mindspeed_tp.check.bisect import compare_modules

    b, s = 2, 3
    real = torch.ones(b, s, dtype=torch.bool)
    x = torch.arange(b * s * 4, dtype=torch.float32).reshape(b, s, 4)
    y = x.clone()
    y[1, 2, 0] += 1
    ref = {"embedding": (None, x), "decoder.layers.0.input_layernorm": (x, x)}
    assert compare_modules(ref, ref, real, real)["first_divergence"] is None
    kern = compare_modules({"embedding": (None, x), "decoder.layers.0.input_layernorm": (x, y)}, ref, real, real)
    assert kern["first_divergence"]["classification"] == "kernel"
    assert kern["first_divergence"]["first_token"] == [1, 2] and kern["first_divergence"]["tokens_differing"] == 1
    frame = compare_modules({"embedding": (None, x), "decoder.layers.0.input_layernorm": (y, y)}, ref, real, real)
    assert frame["first_divergence"]["classification"] == "framework"
    route = torch.zeros(b, s, 8, dtype=torch.uint8)
    flipped = route.clone()
    flipped[0, 1, 3] = 1
    r = compare_modules({"decoder.layers.0.mlp.router": (x, flipped)}, {"decoder.layers.0.mlp.router": (x, route)},
                        real, real)
    assert r["first_divergence"]["classification"] == "framework" and r["routing_differs_layers"] == [0]
    z = x.clone()
    z[0, 1, 2] = float("nan")
    n = compare_modules({"output_layer": (x, z)}, {"output_layer": (x, x)}, real, real)["modules"][0]
    assert n["nonfinite_values"] == 1 and n["first_nonfinite"] == [0, 1]
