"""Settings under which the real engine's arithmetic is not the one a ``vllm-cpu-*`` profile
describes: refused by name (ConfigError), never run with a silent mismatch."""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from ...contract.refusals import refuse

SUPPORTED_VERSIONS = ("0.32.0",)  # the vllm-cpu releases whose kernels the profiles were built on


def require_vllm(version_spec: Optional[str] = None) -> str:
    """The installed vLLM's version; ConfigError if vLLM is missing or another version."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            installed = version("vllm-cpu")
        except PackageNotFoundError:
            installed = version("vllm")
    except Exception:  # noqa: BLE001 - PackageNotFoundError for both names
        raise refuse("vllm_missing")
    installed = installed.split("+")[0]
    allowed = _versions(version_spec)
    if installed not in allowed:
        raise refuse("vllm_version", installed=installed, allowed=sorted(allowed), first=allowed[0])
    return installed


def _versions(spec: Optional[str]):
    if not spec:
        return list(SUPPORTED_VERSIONS)
    return [v.strip().lstrip("=") for v in str(spec).split(",") if v.strip()]


def check_engine_settings(env: Mapping[str, str], tp: int, prefix_caching: bool = False,
                          enforce_eager: bool = True) -> None:
    """The engine settings the profiles assume; each violation named with the setting to change."""
    from .host import check_amx_hidden

    check_amx_hidden(env)  # this process, and the environment the engine's processes start with
    threads = int(env.get("OMP_NUM_THREADS", "0") or 0)
    if threads != 1:
        raise refuse("vllm_engine_threads", threads=threads or "unset")
    if env.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        raise refuse("vllm_batch_invariant")
    if prefix_caching:
        raise refuse("vllm_prefix_caching")
    if not enforce_eager:
        raise refuse("vllm_not_eager")
    if tp < 1 or tp & (tp - 1):
        raise ValueError(f"engine tensor_parallel_size={tp}: use a power of two")


def activation_widths(model) -> Dict[str, Optional[int]]:
    """The intermediate sizes the engine's SiLU-and-mul runs on (dense and shared-expert MLPs; routed
    experts run in the engine's fused MoE kernel), from a TransformerConfig or a model spec. A model
    whose every layer is MoE (Mixtral) runs no dense MLP: its ffn_hidden_size is no row width."""
    widths = {name: getattr(model, name, None) for name in ("ffn_hidden_size", "moe_shared_expert_intermediate_size")}
    if not _has_dense_layers(model):
        widths.pop("ffn_hidden_size")
    return widths


def _has_dense_layers(model) -> bool:
    experts = getattr(model, "num_experts", None) or getattr(model, "num_moe_experts", None)
    if not experts:
        return True
    if hasattr(model, "first_k_dense"):  # a model spec
        return model.first_k_dense > 0
    freq = getattr(model, "moe_layer_freq", 1)  # a TransformerConfig: an int N (every N-th layer MoE) or a list
    return 0 in freq if isinstance(freq, (list, tuple)) else int(freq) != 1


def check_activation_widths(widths, engine_tp: int, dtype) -> None:
    """The engine's SiLU-and-mul (vLLM's ``forward_native`` on x86: ATen's silu on a ``torch.chunk`` view)
    computes the last ``width mod step`` elements of each row with ATen's scalar code: a row width (an
    MLP's intermediate size over the engine's TP) must be a multiple of the loop step for the engine to
    compute every element as training does (``kernels/elementwise.py``). ``widths``: name -> size."""
    from ...kernels.elementwise import loop_step

    step = loop_step(dtype)
    for name, size in widths.items():
        if size and (int(size) // engine_tp) % step:
            raise refuse("vllm_activation_width", setting=name, size=size, tp=engine_tp, width=int(size) // engine_tp,
                         step=step, dtype=str(dtype).replace("torch.", ""),
                         capability=torch.backends.cpu.get_cpu_capability())


def check_head_dim(head_dim: int) -> None:
    """The head size must be one the installed vLLM's CPU attention backend supports (asked from it):
    vllm-cpu 0.32 starts with head_dim 16 and dies in its kernel on AVX-512 hosts."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if not CPUAttentionBackend.supports_head_size(int(head_dim)):
        raise refuse("vllm_head_dim", head_dim=head_dim, supported=CPUAttentionBackend.get_supported_head_sizes())


def check_partial_rope_dtype(rotary_percent: float, dtype) -> None:
    """A partial-RoPE model (GLM-4.5) matches the engine bitwise in bf16; in fp32 the engine's logprobs
    differ from this profile's in the last bit at a few tokens (measured: 2-7 of 48 sampled tokens,
    the same rotary kernel call on both sides, the cause not found), so fp32 is refused by name."""
    if rotary_percent != 1.0 and dtype == torch.float32:
        raise refuse("vllm_model_shape", what=f"partial RoPE (rotary_percent={rotary_percent}) in fp32",
                     engine="partial RoPE matched bitwise in bf16 only", fix="score in bf16 (--dtype bf16)")


def check_swiglu(glu) -> None:
    """The engine's dense and expert MLPs compute SiLU-and-mul: a clamped, offset or quick-GELU GLU
    (gpt-oss', which vLLM computes with its own swigluoai kernel, not modelled) is refused by name.
    ``glu``: contract.model_config.glu_of(config)."""
    if glu != ("silu", None, 0.0):
        raise refuse("vllm_model_shape", what=f"the gated MLP (activation, clamp, offset)={glu}",
                     engine="SiLU-and-mul MLPs (gpt-oss' clamped GLU runs vLLM's swigluoai kernel, not modelled)",
                     fix="use activation_func=F.silu without activation_func_clamp_value or glu_linear_offset")


def check_engine_architecture(spec) -> None:
    """Before an engine starts, from the model spec: gpt-oss' pieces, which the engine's gpt_oss.py runs
    with kernels the profiles do not model (its GLU, biases, sinks, alternating windows), by name."""
    check_swiglu((spec.activation_func, spec.activation_func_clamp_value, float(spec.glu_linear_offset)))
    for present, what, fix in (
            (spec.add_bias_linear, "biases on every linear layer (add_bias_linear)", "set add_bias_linear: false"),
            (spec.attention_sinks, "attention sinks (attention_sinks)", "set attention_sinks: false"),
            (spec.window_attn_skip_freq is not None, "alternating windowed and full layers (window_attn_skip_freq)",
             "unset window_attn_skip_freq")):
        if present:
            raise refuse("vllm_model_shape", what=what, engine="none (gpt-oss' layers run vLLM's own kernels, not "
                         "modelled)", fix=fix)
