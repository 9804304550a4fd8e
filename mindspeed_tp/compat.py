"""Every megatron-core version difference mindspeed-tp relies on, in one place.

Supported lines: 0.12.x (what MindSpeed 2.x targets), 0.16.x (MindSpeed core_r0.16.0) and 0.19.x
(what verl 0.9 and Megatron-Bridge track). 0.12 mappings take no process group (they use the global
TP group); 0.16 threads ``tp_group`` through modules and mappings; 0.19 also passes it to
``vocab_parallel_cross_entropy`` and passes ``gtp_remat_size`` to the column-parallel GEMM (both
handled by the patches' own signatures).
"""
import contextlib
import functools
import importlib.util
import inspect
import os
import warnings
from typing import Optional, Tuple

SUPPORTED_LINES: Tuple[Tuple[int, int], ...] = ((0, 12), (0, 16), (0, 19))
# Set to 1 to silence the warning for a megatron-core line the test suite does not run.
ALLOW_UNTESTED_ENV = "MINDSPEED_TP_ALLOW_UNTESTED_MEGATRON"
_warned = set()


def megatron_version() -> str:
    try:
        from megatron.core.package_info import __version__
    except ImportError:  # pragma: no cover - megatron-core absent
        return "not installed"
    return __version__


def megatron_line() -> Tuple[int, int]:
    major, minor = megatron_version().split(".")[:2]
    return int(major), int(minor)


def warn_if_untested_line() -> None:
    """enable(): warn once, naming the tested lines, when the installed megatron-core is not one."""
    version = megatron_version()
    if version == "not installed" or os.environ.get(ALLOW_UNTESTED_ENV, "") == "1":
        return
    line = megatron_line()
    if line in SUPPORTED_LINES or line in _warned:
        return
    _warned.add(line)
    tested = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_LINES)
    warnings.warn(f"mindspeed-tp: megatron-core {version} is not a tested line (tested: {tested}); patch "
                  f"targets may have moved or changed signature. Run `mindspeed-tp check` before trusting "
                  f"bitwise results; set {ALLOW_UNTESTED_ENV}=1 to silence this", RuntimeWarning, stacklevel=3)


def _mappings_take_group() -> bool:
    return megatron_line() >= (0, 13)


def tp_group_of(module=None):
    """The tensor-parallel process group a module works in."""
    group = getattr(module, "tp_group", None) if module is not None else None
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def copy_to_tensor_model_parallel_region(x, group):
    from megatron.core.tensor_parallel import mappings

    if _mappings_take_group():
        return mappings.copy_to_tensor_model_parallel_region(x, group=group)
    return mappings.copy_to_tensor_model_parallel_region(x)


def scatter_to_tensor_model_parallel_region(x, group):
    from megatron.core.tensor_parallel import mappings

    if _mappings_take_group():
        return mappings.scatter_to_tensor_model_parallel_region(x, group=group)
    return mappings.scatter_to_tensor_model_parallel_region(x)


def gather_from_sequence_parallel_region(x, group):
    from megatron.core.tensor_parallel import mappings

    return mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)


def local_mla_query_projection_problem() -> Optional[str]:
    """Why this line's local spec cannot build MLA's one query projection (q_lora_rank unset), or None:
    from megatron-core 0.19 (its mla_qk_norm_config) that projection is only Transformer Engine's fused
    norm + linear. Read from the installed files, without importing megatron-core."""
    core = importlib.util.find_spec("megatron.core")
    locations = list(core.submodule_search_locations or []) if core else []
    if any(os.path.exists(os.path.join(p, "transformer", "mla_qk_norm_config.py")) for p in locations):
        return (f"megatron-core {megatron_version()}'s local spec builds MLA's query projection without a query "
                f"latent only as Transformer Engine's fused norm + linear")
    return None


@functools.lru_cache(maxsize=None)
def rope_takes_mla_flag() -> bool:
    """megatron-core >= 0.19's RoPE takes mla_rotary_interleaved (earlier lines read the config's
    multi_latent_attention instead)."""
    from megatron.core.models.common.embeddings import rope_utils

    return "mla_rotary_interleaved" in inspect.signature(rope_utils._apply_rotary_pos_emb_bshd).parameters


@functools.lru_cache(maxsize=None)
def gpt_model_has_yarn() -> bool:
    """GPTModel builds YaRN (position_embedding_type 'yarn') on megatron-core >= 0.14; 0.12's has none."""
    from megatron.core.models.gpt import gpt_model

    return hasattr(gpt_model, "YarnRotaryEmbedding")


def attention_scale(module) -> float:
    """Softmax scale of a DotProductAttention (same attribute on both lines)."""
    return float(module.softmax_scale)


def forget_stale_embedding_ranks(parallel_state) -> None:
    """megatron-core 0.12's destroy_model_parallel forgets the (position) embedding groups but not their
    global ranks: a rank outside the next layout's position-embedding group then reads as inside it
    and asserts on the missing group. Later lines reset them too; resetting again is a no-op there."""
    for name in ("_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS"):
        setattr(parallel_state, name, None)


def grads_for_grad_norm(optimizer):
    """The gradients a megatron optimizer's norm covers (each once: shared and TP-duplicated ones
    filtered): ``get_grads_for_grad_norm`` from megatron-core 0.19, ``get_main_grads_for_grad_norm``
    before."""
    fn = getattr(optimizer, "get_grads_for_grad_norm", None) or optimizer.get_main_grads_for_grad_norm
    return fn()


def vanilla_layout_problem(spec, layout):
    """Why vanilla megatron-core cannot run ``layout`` at all (None if it can).

    megatron-core 0.12's expert fc2 reduces over the attention-TP group when expert-TP and EP
    are both 1 but TP > 1 (double-counting; fixed in 0.13). mindspeed-tp's MoE path does not use
    that reduction, so only the vanilla comparison is affected.
    """
    if spec.is_moe and megatron_line() < (0, 13) and layout.tp > 1 and layout.ep == 1 and layout.etp == 1:
        return ("megatron-core 0.12 reduces the expert fc2 over the attention TP group when ep=etp=1 "
                "and tp>1 (an upstream bug fixed in 0.13); vanilla cannot run this layout")
    return None


def supports_gloo_group_flag() -> bool:
    """initialize_model_parallel(create_gloo_process_groups=...) exists (0.12.x and 0.16.x both have it)."""
    import inspect

    from megatron.core import parallel_state

    return "create_gloo_process_groups" in inspect.signature(parallel_state.initialize_model_parallel).parameters


@contextlib.contextmanager
def virtual_pipeline_stage(vp_stage):
    """Build one virtual-pipeline model chunk: yields (GPTModel kwargs, is_pipeline_first/last_stage
    kwargs). 0.16 passes ``vp_stage`` explicitly; 0.12 reads the rank set in parallel_state."""
    if vp_stage is None:
        yield {}, {}
        return
    from megatron.core import parallel_state

    if megatron_line() >= (0, 13):
        yield {"vp_stage": vp_stage}, {"ignore_virtual": False, "vp_stage": vp_stage}
        return
    previous = parallel_state.get_virtual_pipeline_model_parallel_rank()
    parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage)
    try:
        yield {}, {"ignore_virtual": False}
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_rank(previous)
