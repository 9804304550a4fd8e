"""Tiny random Qwen3 / Qwen3-MoE / Qwen2 / Llama / Mistral / Mixtral / GLM-4.5 / DeepSeek-V3 / gpt-oss checkpoints written by transformers itself (config +
save_pretrained), with weights scaled so that logits are far from uniform: a wrong tensor
mapping then moves logprobs by O(1), not by the 1e-3 a near-uniform softmax would show."""
import math
import os

import torch


def _sharpen(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:  # also the tied LM head: keep logits O(1-10)
                p.copy_(0.25 * noise)
            elif name.endswith("bias"):  # Qwen2's QKV bias: O(1), as trained ones are
                p.copy_(noise)
            elif "lm_head" in name:  # untied head: logits of std ~3
                p.copy_(3.0 * noise / math.sqrt(p.shape[-1]))
            else:  # [out, in] (or [experts, out, in]): unit-variance outputs
                p.copy_(noise / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the selection bias: large enough to change choices
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def _write(directory: str, architecture: str, cfg: dict, overrides: dict, seed: int, **save_kwargs) -> str:
    """transformers' ``architecture`` (e.g. "Qwen2") built from ``cfg`` with ``overrides``, seeded,
    sharpened, saved to ``directory``."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, f"{architecture}Config")(**{**cfg, **overrides})
    model = getattr(transformers, f"{architecture}ForCausalLM")(config)
    _sharpen(model, seed)
    model.save_pretrained(directory, **save_kwargs)
    return directory


def make_qwen3(directory: str, seed: int = 0, **overrides) -> str:
    """Dense Qwen3 with tied embeddings, one safetensors file."""
    cfg = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
    return _write(directory, "Qwen3", cfg, overrides, seed)


def make_qwen2(directory: str, seed: int = 2, **overrides) -> str:
    """Qwen2 / Qwen2.5 (QKV bias, no QK-norm, rope_theta 1e6, tied embeddings as the small sizes);
    the biases sharpened like the weights so that a dropped or misplaced bias moves logprobs by O(1)."""
    cfg = dict(vocab_size=1000, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, max_position_embeddings=512, rope_theta=1000000.0, tie_word_embeddings=True,
               use_sliding_window=False)
    return _write(directory, "Qwen2", cfg, overrides, seed)


def make_llama(directory: str, seed: int = 3, **overrides) -> str:
    """Llama-3.1-style (rope_type llama3 with factor 8 over the original 8192 positions, theta 500000:
    the long wavelengths of a 32-wide head are scaled, the middle band interpolated; GQA; untied);
    ``tie_word_embeddings=True, rope_scaling.factor=32`` is Llama-3.2 1B / 3B's shape."""
    cfg = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, head_dim=32, max_position_embeddings=16384, rope_theta=500000.0,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
               tie_word_embeddings=False, rms_norm_eps=1e-5)
    return _write(directory, "Llama", cfg, overrides, seed)


def make_mistral(directory: str, seed: int = 4, **overrides) -> str:
    """Mistral with a sliding window of 24 keys (shorter than the test prompts, crossing the attention's
    key blocks) and Mistral-Nemo's shape: head size 32 with hidden 192, not hidden / heads; untied."""
    cfg = dict(vocab_size=1000, hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, head_dim=32, max_position_embeddings=512, rope_theta=1000000.0,
               sliding_window=24, tie_word_embeddings=False, rms_norm_eps=1e-5)
    return _write(directory, "Mistral", cfg, overrides, seed)


def make_qwen3_moe(directory: str, seed: int = 1, **overrides) -> str:
    """Qwen3-MoE (normalised top-2 of 8 experts, a leading dense layer, untied), saved in shards
    with an index file."""
    cfg = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=512, tie_word_embeddings=False)
    _write(directory, "Qwen3Moe", cfg, overrides, seed, max_shard_size="200KB")
    assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
    return directory


def make_mixtral(directory: str, seed: int = 6, **overrides) -> str:
    """Mixtral (normalised top-2 of 8 experts in every layer, no QK-norm, GQA, untied), saved in
    shards with an index file, as the real ones."""
    cfg = dict(vocab_size=1000, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
               max_position_embeddings=512, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False,
               rms_norm_eps=1e-5)
    _write(directory, "Mixtral", cfg, overrides, seed, max_shard_size="300KB")
    assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
    return directory


def make_glm4_moe(directory: str, seed: int = 7, **overrides) -> str:
    """GLM-4.5 (a leading dense layer, then sigmoid routing on score + a nonzero selection bias, top-2
    of 8 renormalised and scaled by 2.5, one shared expert; QKV bias, RoPE on half of each 32-wide
    head, no QK-norm; untied), saved in shards."""
    cfg = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=8, num_key_value_heads=4, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
               n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
               routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5,
               max_position_embeddings=512, rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
    _write(directory, "Glm4Moe", cfg, overrides, seed, max_shard_size="300KB")
    assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
    return directory


def make_deepseek_v3(directory: str, seed: int = 8, **overrides) -> str:
    """DeepSeek-V3 (multi-latent attention: a 64-wide query latent, a 56-wide kv latent, 16 + 8 query /
    key channels per head with the rope ones interleaved, 12-wide values; YaRN by 4 over 64 original
    positions with mscale = mscale_all_dim = 1; a leading dense layer, then DeepSeek-V3's router with 4
    groups of which 2 are kept, top-4 of 8 scaled by 2.5, one shared expert; untied), saved in shards.
    Moonlight's shape: ``q_lora_rank=None, rope_scaling=None``."""
    cfg = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=56, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=4, n_shared_experts=1,
               first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
               max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6,
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    _write(directory, "DeepseekV3", cfg, overrides, seed, max_shard_size="300KB")
    return directory


def make_gpt_oss(directory: str, seed: int = 9, **overrides) -> str:
    """gpt-oss (top-2 of 8 experts with a router bias in every layer; the clamped quick-GEGLU with up + 1,
    its clamp at 1 so that it bites on these unit-variance values (gpt-oss' 7 on its own scale); biases on
    every linear layer; a sink logit per head; a 16-key window on the first layer, full attention on the
    second; YaRN by 4 over 64 original positions without rounding its ramp ends; GQA; untied), saved in
    shards. The stacked expert tensors are scaled by their own fan-in, the sinks to O(1)."""
    cfg = dict(vocab_size=1000, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
               max_position_embeddings=256, swiglu_limit=1.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**cfg, **overrides}))
    _sharpen(model, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # x @ W: fan-in is dim -2
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-2]))
            elif name.endswith("self_attn.sinks"):
                p.copy_(2.0 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(directory, max_shard_size="300KB")
    assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
    return directory


def save_word_tokenizer(directory: str, vocab_size: int) -> None:
    """A whitespace word-level tokenizer (words w0..wN map to ids 0..N), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(directory)


def transformers_logprobs(directory: str, sequences):
    """Per next-token logprobs of each sequence by transformers' own fp32 forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            logits = model(torch.tensor([seq])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)[:-1]
            out.append(lp.gather(1, torch.tensor(seq[1:]).unsqueeze(1))[:, 0])
    return out
