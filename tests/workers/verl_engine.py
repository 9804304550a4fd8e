"""Worker (torchrun, 2 processes): the real verl 0.9 and mbridge, imported with
VERL_USE_EXTERNAL_MODULES=mindspeed_tp.verl.

Usage: verl_engine.py OUT.safetensors QWEN3_DIR [QWEN3_MOE_DIR]

For the layouts tp1 and tp2-sp and the profiles default (canonical tree) and rollout-tp1:
- the model is built as verl's engine builds it with ``vanilla_mbridge=True`` (where mbridge can build
  models at all: not on megatron-core 0.19, see MBRIDGE_USABLE; there mindspeed-tp's builder does)
  (``verl.models.mcore.mbridge.AutoBridge.from_config(hf_config, dtype)``, ``get_model``,
  ``load_weights`` from the transformers-written checkpoint), here without Transformer Engine;
- the same layout is built by mindspeed-tp's builder and loaded with ``mindspeed_tp.hf``: every
  parameter is compared (``weights_equal/...``: 1 when all are bitwise equal);
- verl's engine forward (``verl.models.mcore.model_forward.gptmodel_forward_model_engine``, what
  ``MegatronEngineWithLMHead.forward_step`` calls with ``use_remove_padding=True``: packed thd
  sequences) runs with the engine's own logits processor
  (``MegatronEngineWithLMHead._lm_head_logits_processor``: temperature divided in place, then
  ``vocab_parallel_log_probs_from_logits``), per-token temperature 0.7.
Rank 0 also scores the same sequences with the reference engine of each profile (rollout-tp1: the
stock TP=1 engine) and saves everything (``lp/<model>/<profile>/<layout>``, ``engine/<model>/<profile>``).
"""
import os
import sys
from functools import partial

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import verl  # noqa: F401  (imports mindspeed_tp.verl from the environment variable)
import mindspeed_tp
from mindspeed_tp.contract.sampling import Sampling
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.check.driver import setup_parallel_state, init_distributed
from mindspeed_tp.hf import open_hf_model
from mindspeed_tp.check.builder import build_gpt_stage
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.weights import load_weights
from mindspeed_tp.contract.profile import load_profile
from mindspeed_tp.reference import ReferenceModel
from verl.models.mcore.model_forward import gptmodel_forward_model_engine
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
from worker_exit import finish_worker

out_path, checkpoints = sys.argv[1], sys.argv[2:]
init_distributed()
install_cpu_shims()
rank = dist.get_rank()
TEMPERATURE = 0.7
LENGTHS = [150, 9, 40, 77]  # crossing a 128-key block, shorter than one, odd lengths
DTYPE = torch.bfloat16


def sequences(vocab):
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]


def mbridge_model(directory):
    """What verl's MegatronEngine does with vanilla_mbridge=True (engine/megatron/transformer_impl.py:
    AutoBridge.from_config + set_extra_args, then verl.utils.megatron_utils.make_megatron_module and
    bridge.load_weights from the checkpoint)."""
    from transformers import AutoConfig
    from verl.models.mcore.mbridge import AutoBridge
    from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module

    hf_config = AutoConfig.from_pretrained(directory)
    bridge = AutoBridge.from_config(hf_config, dtype=DTYPE, make_vocab_size_divisible_by=128)  # pads 1000 -> 1024
    # mbridge's Qwen3-MoE config fuses the SwiGLU and the bias-dropout-add and leaves the router
    # dtype unset: settings mindspeed-tp refuses by name (contract/model_config.py)
    bridge.set_extra_args(attention_dropout=0.0, hidden_dropout=0.0, moe_grouped_gemm=False,
                          gradient_accumulation_fusion=False, bias_activation_fusion=False,
                          bias_dropout_fusion=False, moe_router_dtype="fp32")
    wrap = McoreModuleWrapperConfig(is_value_model=False, wrap_with_ddp=False, use_distributed_optimizer=False)
    model, _ = make_megatron_module(wrap_config=wrap, tf_config=bridge.config, hf_config=hf_config, bridge=bridge)
    bridge.load_weights(model, directory)
    return model


def engine_logprobs(model, seqs):
    """verl's engine forward + its LM-head logits processor; returns the padded (b, s) logprobs."""
    input_ids = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    labels = torch.nested.nested_tensor([s.clone() for s in seqs], layout=torch.jagged)
    temperature = torch.nested.nested_tensor([torch.full((len(s),), TEMPERATURE) for s in seqs],
                                             layout=torch.jagged)
    engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)  # the processor reads no state here
    processor = partial(engine._lm_head_logits_processor, calculate_sum_pi_squared=False, calculate_entropy=False,
                        distillation_use_topk=False, distillation_only=False, logits_processor_func=None,
                        batch=None, data_format="thd")
    with torch.no_grad():
        out = gptmodel_forward_model_engine(model, input_ids, {}, logits_processor=processor,
                                            logits_processor_args={"label": labels, "temperature": temperature},
                                            pad_token_id=0, data_format="thd")
    lp = out["log_probs"]
    padded = torch.zeros(len(seqs), max(LENGTHS))
    for i, row in enumerate(lp.unbind()):
        padded[i, : row.shape[0]] = row.float()
    return padded


def reference_logprobs(spec, profile, weights, seqs):
    """The reference engine: entry t scores token t+1 (verl rolls the labels the same way; its last
    entry wraps to token 0 and is not compared)."""
    ref = ReferenceModel.from_source(spec, profile, weights, DTYPE)
    from mindspeed_tp.reference.model import whole_sequence_kv

    padded = torch.zeros(len(seqs), max(LENGTHS))
    for i, seq in enumerate(seqs):
        logits = ref.forward(seq, torch.arange(len(seq)), [(0, len(seq))], *whole_sequence_kv())
        padded[i, : len(seq) - 1] = ref.logprob(logits[:-1], seq[1:], Sampling(TEMPERATURE, semantics="temperature"))
    return padded


# mbridge 0.15.1 builds models with ModelType.encoder_and_decoder, which megatron-core 0.19 removed:
# there (upstream) it cannot build any model, and the engine forward runs on mindspeed-tp's builder.
from megatron.core.enums import ModelType

MBRIDGE_USABLE = hasattr(ModelType, "encoder_and_decoder")
out = {"mbridge_usable": torch.tensor([int(MBRIDGE_USABLE)])}
for directory in checkpoints:
    name = os.path.basename(directory)
    for profile_name in ("default", "rollout-tp1"):
        profile = load_profile(profile_name)
        mindspeed_tp.enable(profile)
        spec, weights = open_hf_model(directory, profile)
        seqs = sequences(spec.vocab_size)
        for layout_name in ("tp1", "tp2-sp"):
            layout = Layout.parse(layout_name)
            setup_parallel_state(layout, 0)
            if spec.is_moe and layout.tp > 1 and MBRIDGE_USABLE:  # local-spec experts at TP=EP=1 only: refused
                try:
                    mbridge_model(directory)
                    refused = 0
                except mindspeed_tp.ConfigError as exc:
                    refused = int("SequentialMLP" in str(exc))
                out[f"refused/{name}/{profile_name}/{layout_name}"] = torch.tensor([refused])
                continue
            if spec.is_moe and layout.tp > 1:
                continue
            ours = build_gpt_stage(spec, layout, DTYPE, profile)
            load_weights(ours, spec, layout, weights)
            if not MBRIDGE_USABLE:
                out[f"lp/{name}/{profile_name}/{layout_name}"] = engine_logprobs(ours, seqs)
                continue
            bridged = mbridge_model(directory)
            theirs = dict(bridged[0].module.named_parameters())
            equal = all(torch.equal(p, theirs[n]) for n, p in ours.named_parameters()) and \
                len(theirs) == len(dict(ours.named_parameters()))
            flag = torch.tensor([int(equal)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # 1 only if every rank's shard is equal
            out[f"weights_equal/{name}/{profile_name}/{layout_name}"] = flag
            out[f"lp/{name}/{profile_name}/{layout_name}"] = engine_logprobs(bridged[0], seqs)
        if rank == 0:
            out[f"engine/{name}/{profile_name}"] = reference_logprobs(spec, profile, weights, seqs)
            out[f"lengths/{name}"] = torch.tensor(LENGTHS)
if rank == 0:
    save_file({k: v.contiguous() for k, v in out.items()}, out_path)
finish_worker()
