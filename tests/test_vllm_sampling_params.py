"""The installed vLLM's SamplingParams, every field classified (contract/sampling_params.py) and
checked as vLLM builds it while mindspeed-tp is enabled: a field whose logits processor training
never models is refused naming it, in the process that builds the request -- verl's vLLM server
imports mindspeed_tp.verl, so verl's rollout sampling keys meet the same check. No engine starts
(.venv-vllm only; also on AMX hosts)."""
import os

import pytest

from conftest import ROOT, explain, run_python

from mindspeed_tp.contract import sampling_params as sp


def test_every_sampling_params_field_is_classified_with_an_existing_test():
    from vllm import SamplingParams

    names = sp.field_names(SamplingParams)
    assert [n for n in names if sp.classify(n) is None] == []
    for name, test in sp.HONOURED.items():
        path, fn = test.split("::")
        with open(os.path.join(ROOT, path)) as f:
            assert f"def {fn}(" in f.read(), (name, test)
    defaults = sp.field_defaults(SamplingParams)
    for name, (accepts, _) in sp.REFUSED.items():
        assert name in names and accepts(defaults[name]), name  # every refused field's default is accepted


# A value of each refused field that changes the sampled distribution.
REFUSED_VALUES = {"n": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.05,
                  "min_p": 0.05, "min_tokens": 2, "logit_bias": {3: 1.0}, "allowed_token_ids": [1, 2, 3],
                  "bad_words": ["x"], "thinking_token_budget": 4, "extra_args": {"k": 1},
                  "logprob_token_ids": [1], "watermarking": "STRUCTURED", "structured_outputs": "JSON"}

CODE = """
import mindspeed_tp
mindspeed_tp.enable()
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
import json
values = json.loads({values!r})
values["logit_bias"] = {{3: 1.0}}
values["structured_outputs"] = StructuredOutputsParams(json={{"type": "object"}})
values.pop("watermarking")
# verl 0.9's request (vLLMHttpServer.generate) and the project's engine requests are accepted
SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, top_k=20, repetition_penalty=1.0, logprobs=0,
               ignore_eos=False, seed=3)
SamplingParams(temperature=0.8, top_p=0.95, watermarking=False)  # off, as vLLM's workers receive verl's requests
SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, max_tokens=4, ignore_eos=True, logprobs=-1, seed=1,
               detokenize=False, stop_token_ids=[2])
print("ACCEPTED")
for name, value in values.items():
    try:
        SamplingParams(**{{name: value}})
        print("NOT REFUSED", name)
    except mindspeed_tp.ConfigError as exc:
        print("REFUSED", name, f"SamplingParams({{name}}=" in str(exc))
mindspeed_tp.disable()
SamplingParams(min_p=0.05, repetition_penalty=1.05)
print("VANILLA ACCEPTED")
"""


def test_a_sampling_field_training_does_not_model_is_refused_by_name_while_enabled():
    import json

    from vllm import SamplingParams

    proc = run_python(CODE.format(values=json.dumps({k: v for k, v in REFUSED_VALUES.items() if k != "logit_bias"})))
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout
    assert "ACCEPTED" in out and "VANILLA ACCEPTED" in out, explain(proc)
    names = [n for n in sp.REFUSED if n != "watermarking" and n in sp.field_names(SamplingParams)]
    for name in names:
        assert f"REFUSED {name} True" in out, (name, explain(proc))
    assert "NOT REFUSED" not in out, explain(proc)
