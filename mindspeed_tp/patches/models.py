"""Patch of GPTModel construction: mark the LM head for fp32 logits and the model's structure
(``models.marks``), let the active strategy see the construction, and refuse models built from
modules the patch set does not cover (instead of silently running them non-invariantly)."""
import functools

import torch

from ..contract.model_arguments import bound_arguments, check_gpt_model_arguments
from ..contract.model_config import check_model_config
from ..contract.refusals import refuse
from ..errors import ConfigError
from .. import state
from ..models.marks import (TRUE_VOCAB_ATTR, mark_expert_biases, mark_gated_fc1, mark_mla_kv_up, mark_routers,
                            mark_row_parallel_biases, mark_tied_head, true_vocab_of)
from ..numerics import ACTIVE
from ..patching import PatchRegistry

# Module families whose numerics no patch here controls: (module prefix, refusal).
_UNCOVERED = (
    ("megatron.core.extensions.transformer_engine", "transformer_engine"),
    ("apex.", "apex"),
    # What megatron-core's local spec builds for LayerNorm when apex imports (GPU installs): the
    # class lives in megatron's namespace, the arithmetic is apex's kernel.
    ("megatron.core.fusions.fused_layer_norm", "megatron_fused_layer_norm"),
    # MindSpeed puts these under megatron's TE names (TEColumnParallelLinear, TEDotProductAttention, ...)
    ("mindspeed.te.", "mindspeed_te"),
)
_UNCOVERED_CLASSES = {"GroupedMLP": "grouped_mlp"}


def _profile():
    return getattr(ACTIVE.strategy, "profile", None)


def validate_model_modules(model) -> None:
    config = getattr(model, "config", None)
    if config is not None:
        check_model_config(config, _profile())
    for name, module in model.named_modules():
        cls = type(module)
        for prefix, key in _UNCOVERED:
            if cls.__module__.startswith(prefix):
                raise refuse(key, name=name or "model", cls=cls.__name__)
        if cls.__name__ in _UNCOVERED_CLASSES:
            raise refuse(_UNCOVERED_CLASSES[cls.__name__], name=name)


def check_not_displaced(registry: PatchRegistry) -> None:
    """Refuse to build a model while another patcher holds some of our targets: MindSpeed's patch
    manager, imported or re-applied (``repatch``) after mindspeed-tp, rebinds the same names."""
    displaced = [p.target for p in registry.displaced()]
    if displaced:
        raise ConfigError(
            f"mindspeed-tp patches were replaced after they were enabled ({', '.join(displaced)}), e.g. by "
            f"mindspeed.megatron_adaptor imported or MindSpeed's repatch() run afterwards: import "
            f"mindspeed_tp.megatron_adaptor after mindspeed.megatron_adaptor, or call mindspeed_tp.enable() "
            f"again after repatch()"
        )


def gpt_model_init(original, registry: PatchRegistry):
    def __init__(self, *args, **kwargs):
        check_not_displaced(registry)
        arguments = bound_arguments(original, args, kwargs)
        # before building: some refused settings fail megatron's own init on CPU
        check_model_config(arguments["config"], _profile())
        check_gpt_model_arguments(arguments)
        ACTIVE.strategy.model_init(original, self, args, kwargs)
        original(self, *args, **kwargs)
        validate_model_modules(self)
        head = getattr(self, "output_layer", None)
        if head is not None:
            head._mindspeed_tp_logits = True
        mark_gated_fc1(self)
        mark_mla_kv_up(self)
        mark_routers(self)
        mark_row_parallel_biases(self)
        mark_expert_biases(self)
        mark_tied_head(self)

    return __init__


def gpt_model_forward(original):
    """GPTModel.forward with the model's true vocab (``models.marks.true_vocab_of``) known to the LM
    head and the loss inside it, and marked on the logits it returns: a logprob computed from them
    outside the model (verl's) excludes the padded columns by it."""

    def forward(self, *args, **kwargs):
        for name in ("inference_context", "inference_params"):  # the latter: megatron-core 0.12
            if kwargs.get(name) is not None:
                raise refuse("inference_context", name=name)
        vocab = true_vocab_of(self)
        with state.model_vocab_size(vocab or state.model_vocab()):
            out = original(self, *args, **kwargs)
        if vocab and isinstance(out, torch.Tensor):
            setattr(out, TRUE_VOCAB_ATTR, vocab)
        return out

    return forward


def _holds_megatron_modules(target) -> bool:
    module = getattr(target, "__self__", target)  # nn.Module.compile() passes its bound _call_impl
    return isinstance(module, torch.nn.Module) and any(
        type(m).__module__.startswith(("megatron.core", "mindspeed_tp")) for m in module.modules())


def guarded_compile(original):
    """torch.compile refusing, while the patches are on, anything that holds megatron-core modules
    (a refusal inside the patched code cannot work: dynamo breaks the graph and runs it eagerly)."""

    @functools.wraps(original)
    def compile(model=None, *args, **kwargs):
        if ACTIVE.on and model is not None and _holds_megatron_modules(model):
            raise refuse("torch_compile", what=type(getattr(model, "__self__", model)).__name__)
        return original(model, *args, **kwargs)

    return compile


def register(reg: PatchRegistry) -> None:
    reg.register("torch:compile", "refuses torch.compile of modules holding megatron-core modules while the patches "
                 "are on (compiled graphs reorder the patched arithmetic)", wraps=True)(guarded_compile)
    reg.register(
        "megatron.core.models.gpt.gpt_model:GPTModel.__init__",
        "marks output_layer so the LM head GEMM returns fp32 logits; rejects modules no patch covers "
        "(Transformer Engine, apex norms incl. megatron's FusedLayerNorm, grouped-GEMM experts)",
        wraps=True,
    )(lambda original: gpt_model_init(original, reg))
    reg.register("megatron.core.models.gpt.gpt_model:GPTModel.forward",
                 "the model's true vocab size known to the LM head and the loss, and marked on the logits it returns "
                 "(a logprob computed outside the model, as verl's, excludes the padded columns by it)",
                 wraps=True)(gpt_model_forward)
