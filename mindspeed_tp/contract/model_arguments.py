"""Every GPTModel constructor argument of the supported megatron-core lines, classified once:
honoured (the test that shows its bits are kept, or the check that covers it), refused at any
value but the accepted ones (``refuse("gpt_model_argument")`` names it), or irrelevant (why).
``patches/models.py`` checks every construction's bound arguments before megatron builds anything;
tests/test_config_fields.py walks the installed signature: an argument a newer line adds fails it
until it is classified here. The TransformerConfig's fields: ``config_fields.py``."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Tuple

from .refusals import refuse

_LAYOUT = "tests/test_parity_dense.py::test_every_layout_bitwise_equal_to_single_device"
_TIED = ("tests/test_bitwise_training.py::"
         "test_tied_embeddings_and_a_non_power_of_two_run_of_vocab_leaves_every_step_bitwise")
_ENGINE = "tests/test_reference_engine.py::test_engine_weights_and_rope_match_megatron_tp1"
_TRAIN = "tests/test_train_check.py::test_step1_loss_and_in_step_logprobs_bitwise_in_every_layout"

HONOURED: Dict[str, str] = {
    "config": "tests/test_config_fields.py::test_every_refused_field_alone_at_another_value_is_refused_naming_it",
    "transformer_layer_spec": "tests/test_mindspeed_coexistence.py::test_mindspeed_te_replacements_are_refused",
    "vocab_size": _LAYOUT,  # the padded size; the true one excluded by the loss (contract: vocab)
    "max_sequence_length": _ENGINE,
    "pre_process": _LAYOUT,
    "post_process": _LAYOUT,
    "share_embeddings_and_output_weights": _TIED,
    "rotary_base": _TIED,  # one frequency table megatron computes alike on every rank; the engines rebuild it
    # Llama-3's scaled RoPE (low / high factors and original context fixed in megatron-core)
    **{name: "tests/test_families.py::test_bitwise_training_two_layouts[llama31]"
       for name in ("rope_scaling", "rope_scaling_factor")},
    # partial rotary: the canonical RoPE rotates the leading channels of megatron's shorter angle table
    "rotary_percent": "tests/test_families_moe.py::test_megatron_matches_transformers_and_ep_layouts_are_bitwise_fp32",
    "vp_stage": _TRAIN,
    # the patches work in parallel_state's groups: a collection of those groups (Megatron-Bridge's
    # use_mpu_process_groups) is accepted, another refused (check_process_groups)
    "pg_collection": "tests/test_config_fields.py::test_every_gpt_model_argument_is_classified_and_refused_by_name",
}

# argument -> (accepts, what is accepted); any other value is refused naming the argument.
REFUSED: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "fp16_lm_cross_entropy": (lambda v: not v, "False (fp16 logits are not checked)"),
    "parallel_output": (bool, "True (vocab-parallel logits; the gathered logits are not the checked path)"),
    # yarn: YaRN's frequencies and concentration factor from the config's yarn_* attributes (gpt-oss,
    # Qwen2.5 / Qwen3 long context), on the whole head
    "position_embedding_type": (lambda v: v in ("rope", "yarn"), "'rope' or 'yarn' (the position encodings the "
                                "reference engine models)"),
    "seq_len_interpolation_factor": (lambda v: v is None, "None (interpolated positions are not modelled)"),
    "mtp_block_spec": (lambda v: v is None, "None (multi-token prediction layers are refused)"),
    "scatter_embedding_sequence_parallel": (bool, "True (megatron's default; the sequence-parallel layout checked)"),
}

IRRELEVANT: Dict[str, str] = {}


def classify(name: str):
    for kind, table in (("honoured", HONOURED), ("refused", REFUSED), ("irrelevant", IRRELEVANT)):
        if name in table:
            return kind, table[name]
    return None


def bound_arguments(init, args, kwargs) -> Dict[str, Any]:
    """GPTModel.__init__'s arguments by name, defaults filled (``init`` unbound, args without self)."""
    bound = inspect.signature(init).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return {k: v for k, v in list(bound.arguments.items())[1:]}


def check_gpt_model_arguments(arguments: Dict[str, Any]) -> None:
    """Refuse, naming it, every argument the contract cannot keep and every one not classified
    (a newer line's argument is refused until it is classified, never swallowed)."""
    for name, value in arguments.items():
        kind = classify(name)
        if kind is None:
            raise refuse("gpt_model_argument", name=name, value=value,
                         accepted="its default (an argument of the installed megatron-core mindspeed-tp does not know)")
        if kind[0] == "refused" and not REFUSED[name][0](value):
            raise refuse("gpt_model_argument", name=name, value=value, accepted=REFUSED[name][1])
    if arguments.get("position_embedding_type") == "yarn" and float(arguments.get("rotary_percent", 1.0)) != 1.0:
        # megatron's YarnRotaryEmbedding computes its frequencies over the whole head whatever rotary_percent says
        raise refuse("gpt_model_argument", name="rotary_percent", value=arguments["rotary_percent"],
                     accepted="1.0 with position_embedding_type='yarn' (megatron's YaRN table covers the whole head)")
    check_process_groups(arguments.get("pg_collection"))


# pg_collection attribute -> parallel_state getter of the group the patches use
_GROUPS = (("tp", "get_tensor_model_parallel_group"), ("cp", "get_context_parallel_group"),
           ("pp", "get_pipeline_model_parallel_group"), ("ep", "get_expert_model_parallel_group"),
           ("expt_tp", "get_expert_tensor_parallel_group"))


def _ranks(group):
    import torch.distributed as dist

    return None if group is None else dist.get_process_group_ranks(group)


def check_process_groups(collection: Any) -> None:
    """A ``pg_collection`` whose groups are not parallel_state's is refused: the patched layers'
    collectives and trees follow parallel_state's groups."""
    if collection is None:
        return
    from megatron.core import parallel_state

    for attr, getter in _GROUPS:
        group = getattr(collection, attr, None)
        if group is None or not hasattr(parallel_state, getter):
            continue
        expected = getattr(parallel_state, getter)(check_initialized=False)
        if group is not expected and _ranks(group) != _ranks(expected):
            raise refuse("gpt_model_argument", name=f"pg_collection.{attr}", value=_ranks(group),
                         accepted=f"megatron's parallel_state group ({_ranks(expected)})")
