"""Every field of the installed vLLM's ``SamplingParams``, classified once: honoured (the test that
shows the sampled tokens' logprobs stay bitwise under it), refused at any value but its default
(what training never models: the logits processors that reshape the distribution a token is
sampled from), or irrelevant (what is returned, not what is computed). verl's rollout sampling keys
reach vLLM as these fields (verl's ``vLLMHttpServer.generate`` passes its dict and the rollout
config's ``repetition_penalty`` to ``SamplingParams``), so the check at ``SamplingParams``
construction (``integrations/vllm_sampling.py``: every process where mindspeed-tp is enabled)
covers the verl entry. tests/test_vllm_profile.py walks the installed fields: one a newer vLLM adds
is refused until it is classified here. The checkers' own flags: ``contract/sampling.py``."""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Tuple

from .refusals import refuse

_SAMPLING = "tests/test_vllm_sampling.py::test_every_semantics_is_bitwise_in_two_layouts_and_vanilla_is_not"
_ENGINE = "tests/test_vllm_engine.py::test_response_logprobs_bitwise_equal_to_vllm_in_every_layout"
_RL = "tests/test_rl_vllm.py::test_rl_loop_with_vllm_at_temperature_bitwise_every_iteration"

HONOURED: Dict[str, str] = {
    "temperature": _SAMPLING, "top_k": _SAMPLING, "top_p": _SAMPLING,
    "seed": _ENGINE,  # which token is drawn; its logprob is computed alike
    "max_tokens": _ENGINE, "ignore_eos": _ENGINE, "stop_token_ids": _RL,  # where a response ends
    "logprobs": _ENGINE,  # 0: the sampled token's logprob (what is compared)
}

# field -> (accepts, what is accepted)
_OFF = (lambda v: v in (None, 0, 0.0), "0 / unset")
REFUSED: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    # parallel sampling decodes a request's n sequences as one batch: never checked (verl's rollout.n
    # sends n requests of n=1, which is)
    "n": (lambda v: v in (None, 1), "1 (verl: rollout.n repeats the request)"),
    "presence_penalty": _OFF,
    "frequency_penalty": _OFF,
    "repetition_penalty": (lambda v: v in (None, 1, 1.0), "1.0"),
    "min_p": _OFF,
    "min_tokens": _OFF,  # its processor sets the stop tokens to -inf until then
    "logit_bias": (lambda v: not v, "unset"),
    "allowed_token_ids": (lambda v: v is None, "unset"),
    "bad_words": (lambda v: not v, "[]"),
    "structured_outputs": (lambda v: v is None, "unset (guided decoding masks the logits)"),
    "watermarking": (lambda v: v in (None, False), "unset or False (a watermark biases the logits)"),
    "thinking_token_budget": (lambda v: v is None, "unset (the engine forces tokens past the budget)"),
    "extra_args": (lambda v: not v, "unset (custom logits processors read it)"),
    "logprob_token_ids": (lambda v: v is None, "unset (the sampled token's logprob is what is compared)"),
}

_OUTPUT = "what the engine returns or how it streams it, not what it computes"
IRRELEVANT: Dict[str, str] = {
    **{name: _OUTPUT for name in (
        "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
        "output_kind", "stream_interval", "skip_clone", "output_text_buffer_length", "flat_logprobs",
        "trace_decode_token_ids", "routed_experts_prompt_start")},
    **{name: "the prompt's logprobs are not compared (the sampled tokens' are)" for name in (
        "prompt_logprobs", "prompt_logprob_token_ids", "prompt_logprob_start")},
    "stop": "stop strings end a response; the logprobs of its tokens are unchanged",
    "repetition_detection": "stops a looping response early; the logprobs of its tokens are unchanged",
    "skip_reading_prefix_cache": "prefix caching is refused at the engine (vllm_prefix_caching)",
    **{name: "vLLM's own derived state of the fields above" for name in (
        "_eos_token_id", "_all_stop_token_ids", "_watermarking_skipped", "_bad_words_token_ids")},
}


def classify(name: str):
    for kind, table in (("honoured", HONOURED), ("refused", REFUSED), ("irrelevant", IRRELEVANT)):
        if name in table:
            return kind, table[name]
    return None


def field_names(params_type: Any) -> Tuple[str, ...]:
    """The fields of vLLM's ``SamplingParams`` (a msgspec Struct; a dataclass in older releases)."""
    import dataclasses

    if dataclasses.is_dataclass(params_type):
        return tuple(f.name for f in dataclasses.fields(params_type))
    return tuple(params_type.__struct_fields__)


@functools.lru_cache(maxsize=None)
def field_defaults(params_type: Any) -> Dict[str, Any]:
    """Each field's default, read off the type (building one would run the patched check again);
    once per type: the check runs at every request."""
    import dataclasses

    if dataclasses.is_dataclass(params_type):
        fields = dataclasses.fields(params_type)
        return {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
                for f in fields}
    import msgspec

    out = {}
    for f in msgspec.structs.fields(params_type):
        out[f.name] = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
    return out


def check_sampling_params(params: Any) -> None:
    """Refuse, naming it, every field of ``params`` (a SamplingParams) the contract cannot keep, and
    every field no table classifies that is not at its default."""
    defaults = field_defaults(type(params))
    for name in field_names(type(params)):
        value = getattr(params, name, None)
        kind = classify(name)
        if kind is None and value != defaults.get(name):
            raise refuse("sampling_parameter", name=name, value=value,
                         accepted="its default (a field of the installed vLLM mindspeed-tp does not know)")
        if kind is not None and kind[0] == "refused" and not REFUSED[name][0](value):
            raise refuse("sampling_parameter", name=name, value=value, accepted=REFUSED[name][1])
