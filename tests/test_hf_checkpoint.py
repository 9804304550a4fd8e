"""Hugging Face Qwen3 / Qwen3-MoE checkpoints: semantics against transformers, bitwise parity
across layouts loaded from the checkpoint, export round trip, and bad checkpoints."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import bits_equal, explain, full_tier, run_cli, run_torchrun
from hf_models import make_qwen3, make_qwen3_moe, save_word_tokenizer, transformers_logprobs
from mindspeed_tp.errors import ConfigError
from mindspeed_tp.hf import SafetensorsCheckpoint, open_hf_model
from mindspeed_tp.contract.profile import load_profile
from mindspeed_tp.reference import ReferenceModel

# fp32 semantics tolerance. Our kernels add in another order than transformers' (8-leaf canonical
# tree in row-parallel GEMMs and the vocab reduction, key-blocked attention, row-padded GEMMs), so
# each op differs by a few ulp (~1e-7 relative); through 2-3 layers and a log-softmax over logits
# of magnitude <= ~20 stays near 1e-5 (measured max: 3.8e-6 dense, 6.7e-6 MoE, both for our single-device
# reference model and the checker's Megatron TP=1 run). A wrong
# tensor mapping (a swapped gate/up, a misplaced GQA head, a dropped norm) moves logprobs by O(0.1-1).
SEMANTICS_ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dense = make_qwen3(str(root / "qwen3-dense"))
    save_word_tokenizer(dense, 1000)
    return {"dense": dense, "moe": make_qwen3_moe(str(root / "qwen3-moe"))}


def _sequences(vocab: int):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 17, 64, 150)]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_reference_model_matches_transformers_fp32(checkpoints, kind):
    profile = load_profile()
    spec, weights = open_hf_model(checkpoints[kind], profile)
    ours = ReferenceModel.from_source(spec, profile, weights, torch.float32).score(_sequences(spec.vocab_size))
    theirs = transformers_logprobs(checkpoints[kind], _sequences(spec.vocab_size))
    assert torch.cat(theirs).std() > 1.0, "logits too uniform for this check to detect a mapping error"
    for a, b in zip(ours, theirs):
        assert (a - b).abs().max() < SEMANTICS_ATOL, (a - b).abs().max()
    # Negative control: the same comparison with gate and up swapped in layer 0 fails by far.
    broken = ReferenceModel.from_source(spec, profile, weights, torch.float32)
    fc1 = broken.w["decoder.layers.0.mlp.linear_fc1.weight"]
    broken.w["decoder.layers.0.mlp.linear_fc1.weight"] = torch.cat(fc1.chunk(2)[::-1])
    worst = max((a - b).abs().max() for a, b in zip(broken.score(_sequences(spec.vocab_size)), theirs))
    assert worst > 100 * SEMANTICS_ATOL, worst


def _prompts_file(path, spec_vocab, text=False):
    lines = [json.dumps(s) for s in _sequences(spec_vocab)]
    lines.append(json.dumps({"input_ids": [7, 8, 9, 10, 11]}))
    if text:
        lines.append(json.dumps({"text": "w5 w17 w300 w999 w2 w2 w41"}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("kind,layouts,nproc", [
    pytest.param("dense", "tp2-sp,tp1-pp2,tp2-sp-pp2", 4, marks=full_tier(
        covered_by="tests/test_hf_checkpoint.py::test_rollout_from_checkpoint_prompts",
        why="a checkpoint's sliced loading scored bitwise at a sharded layout (tp2-sp-ep2 there); the dense "
            "mapping against transformers: test_megatron_single_device_matches_transformers_fp32[dense]")),
    pytest.param("moe", "tp2-sp-ep2,tp1-ep2,tp1-pp2,tp2-sp-ep2-etp2", 4, marks=full_tier(
        covered_by="tests/test_hf_checkpoint.py::test_rollout_from_checkpoint_prompts",
        why="the MoE checkpoint's sliced loading at tp2-sp-ep2 is scored bitwise there (against the reference "
            "engine's rollouts); the layouts themselves: test_parity_moe.py")),
])
def test_layouts_from_checkpoint_bitwise_bf16(checkpoints, tmp_path, kind, layouts, nproc):
    prompts = _prompts_file(tmp_path / "p.jsonl", 1000, text=kind == "dense")
    proc = run_cli("check", "--hf-checkpoint", checkpoints[kind], "--prompts", prompts, "--layouts", layouts,
                   "--dtype", "bf16", "--nproc", str(nproc), "--dump-logprobs", str(tmp_path / "dump"),
                   "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, explain(proc)
    dump = load_file(str(tmp_path / "dump" / "logprobs.safetensors"))
    reference = dump["consistent/reference"]
    for layout in layouts.split(","):
        assert bits_equal(dump[f"consistent/{layout}"], reference), layout
    report = json.loads((tmp_path / "r.json").read_text())
    expected_tokens = sum(len(s) - 1 for s in _sequences(1000)) + 4 + (6 if kind == "dense" else 0)
    assert all(r["tokens"] == expected_tokens for r in report["results"])


@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=full_tier(
    covered_by="tests/test_hf_checkpoint.py::test_rollout_from_checkpoint_prompts",
    why="the MoE mapping: the reference model matches transformers (test_reference_model_matches_transformers_fp32"
        "[moe]) and Megatron's forward of the same checkpoint matches the reference engine bit for bit"))])
def test_megatron_single_device_matches_transformers_fp32(checkpoints, tmp_path, kind):
    """The checker's own TP=1 Megatron run (the reference every layout is compared with)."""
    prompts = _prompts_file(tmp_path / "p.jsonl", 1000)
    proc = run_cli("check", "--hf-checkpoint", checkpoints[kind], "--prompts", prompts, "--layouts", "tp1",
                   "--dtype", "fp32", "--dump-logprobs", str(tmp_path / "dump"))
    assert proc.returncode == 0, explain(proc)
    dump = load_file(str(tmp_path / "dump" / "logprobs.safetensors"))
    sequences = _sequences(1000) + [[7, 8, 9, 10, 11]]
    for i, theirs in enumerate(transformers_logprobs(checkpoints[kind], sequences)):
        ours = dump["consistent/reference"][i, : len(sequences[i]) - 1]
        assert (ours - theirs).abs().max() < SEMANTICS_ATOL, (i, (ours - theirs).abs().max())


def test_rollout_from_checkpoint_prompts(checkpoints, tmp_path):
    prompts = _prompts_file(tmp_path / "p.jsonl", 1000)
    proc = run_cli("check", "--hf-checkpoint", checkpoints["moe"], "--prompts", prompts, "--rollout", "6",
                   "--temperature", "1.0", "--max-new-tokens", "8", "--layouts", "tp2-sp-ep2", "--dtype", "bf16")
    assert proc.returncode == 0, explain(proc)
    assert "bitwise equal to the rollout engine" in proc.stdout


@pytest.mark.parametrize("kind,layout,nproc,shard_bytes", [
    ("moe", "tp2-sp-ep2", 4, "300000"),   # sharded export with an index
    pytest.param("dense", "tp2-sp-pp2", 4, "1000000000", marks=full_tier(  # tied embeddings across stages, one file
        covered_by="tests/test_hf_checkpoint.py::test_export_round_trip_bitwise",
        why="the export's gather of TP, SP and EP shards and its index; the tied weight across a pipeline is the "
            "dense case's addition")),
])
def test_export_round_trip_bitwise(checkpoints, tmp_path, kind, layout, nproc, shard_bytes):
    out = tmp_path / "exported"
    proc = run_torchrun("hf_export.py", nproc, checkpoints[kind], layout, "fp32", str(out), shard_bytes)
    assert proc.returncode == 0, explain(proc)
    original, exported = SafetensorsCheckpoint(checkpoints[kind]), SafetensorsCheckpoint(str(out))
    assert exported.names() == original.names()
    for name in original.names():
        a, b = original.read(name), exported.read(name)
        assert a.dtype == b.dtype and bits_equal(a, b), name
    assert (os.path.isfile(out / "model.safetensors.index.json")) == (kind == "moe")
    assert not any(p.startswith(".") for p in os.listdir(out)), "export parts left behind"
    # transformers reads the export and computes exactly what it computes from the original
    seq = [_sequences(1000)[2]]
    assert bits_equal(transformers_logprobs(str(out), seq)[0], transformers_logprobs(checkpoints[kind], seq)[0])


# -- bad checkpoints: exit 2 / ConfigError naming the problem ----------------------------------

def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def _edit_tensors(directory, edit):
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("change,message", [
    (lambda d: _edit_tensors(d, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight")),
     "missing tensor(s) ['model.layers.1.self_attn.k_norm.weight']"),
    (lambda d: _edit_tensors(d, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})),
     "unexpected tensor(s) ['model.layers.0.self_attn.q_proj.bias']"),
    (lambda d: _edit_tensors(d, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(96, 64)})),
     "tensor model.layers.0.mlp.up_proj.weight has shape [96, 64], config.json implies [128, 64]"),
    (lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"], model_type="llama"), "architectures=['GPT2LMHeadModel']"),
    (lambda d: _edit_config(d, use_sliding_window=True, sliding_window=64), "sliding-window attention"),
    (lambda d: _edit_config(d, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
     "rope_parameters.rope_type='linear' is not implemented"),
    (lambda d: _edit_config(d, rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type='dynamic'"),
    (lambda d: _edit_config(d, attention_bias=True), "attention_bias=true"),
    (lambda d: os.remove(os.path.join(d, "model.safetensors")) or open(os.path.join(d, "pytorch_model.bin"), "wb").write(b"x"),
     "pickle-based files are never loaded"),
])
def test_bad_checkpoint_named(checkpoints, tmp_path, change, message):
    directory = _copy(checkpoints["dense"], tmp_path / "ckpt")
    change(directory)
    with pytest.raises(ConfigError) as err:
        open_hf_model(directory, load_profile())
    assert message in str(err.value)


def test_moe_dense_layers_not_leading_refused(checkpoints, tmp_path):
    directory = _copy(checkpoints["moe"], tmp_path / "ckpt")
    _edit_config(directory, mlp_only_layers=[1])
    with pytest.raises(ConfigError, match=r"mlp_only_layers=\[1\] is not supported"):
        open_hf_model(directory, load_profile())


def test_bad_inputs_exit_2_from_the_cli(checkpoints, tmp_path):
    directory = _copy(checkpoints["moe"], tmp_path / "ckpt")
    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
    index["weight_map"]["model.layers.2.mlp.experts.9.up_proj.weight"] = index["weight_map"]["lm_head.weight"]
    json.dump(index, open(os.path.join(directory, "model.safetensors.index.json"), "w"))
    proc = run_cli("check", "--hf-checkpoint", directory, "--tp", "2")
    assert proc.returncode == 2, explain(proc)
    assert "unexpected tensor(s) ['model.layers.2.mlp.experts.9.up_proj.weight']" in proc.stderr
    proc = run_cli("check", "--hf-checkpoint", checkpoints["moe"], "--model", "tiny-moe")
    assert proc.returncode == 2 and "drop --model" in proc.stderr, explain(proc)
    bad_prompts = tmp_path / "p.jsonl"
    bad_prompts.write_text("[1, 2, 1000]\n")
    proc = run_cli("check", "--hf-checkpoint", checkpoints["moe"], "--prompts", str(bad_prompts))
    assert proc.returncode == 2 and "token id(s) [1000] outside the vocabulary" in proc.stderr, explain(proc)
    bad_prompts.write_text('{"text": "w1 w2"}\n')
    proc = run_cli("check", "--hf-checkpoint", checkpoints["moe"], "--prompts", str(bad_prompts))
    assert proc.returncode == 2 and "no usable tokenizer" in proc.stderr, explain(proc)


def test_qwen3_30b_a3b_config_gives_the_bundled_spec():
    """Qwen/Qwen3-30B-A3B's config.json (transformers 4.51 format: rope_theta, num_experts) maps
    to the bundled qwen3-30b-a3b model config field for field."""
    from mindspeed_tp.hf import spec_from_hf_config
    from mindspeed_tp.models.spec import load_model_spec

    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
           "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
           "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
           "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
           "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
           "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
           "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
           "vocab_size": 151936}
    derived = spec_from_hf_config(cfg, "qwen3-30b-a3b").to_dict()
    assert derived == load_model_spec("qwen3-30b-a3b").to_dict()


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "qwen3-30b-a3b"])
def test_config_json_for_export_maps_back_to_the_spec(name):
    from mindspeed_tp.hf import hf_config_from_spec, spec_from_hf_config
    from mindspeed_tp.models.spec import load_model_spec

    spec = load_model_spec(name)
    assert spec_from_hf_config(hf_config_from_spec(spec), name).to_dict() == spec.to_dict()


def test_deepseek_style_model_is_not_exported_as_qwen3():
    from mindspeed_tp.hf import hf_config_from_spec
    from mindspeed_tp.models.spec import load_model_spec

    with pytest.raises(ConfigError, match="only Qwen3 / Qwen3-MoE style models"):
        hf_config_from_spec(load_model_spec("tiny-moe-shared"))
