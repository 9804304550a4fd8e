"""One engine start of the real vLLM on a checkpoint, greedy decoding of one prompt; with --dummy the
engine starts on dummy weights and gets the checkpoint through mindspeed-tp's in-memory weight sync
(``EngineInfo.mindspeed_tp_load_weights``). Prints the tokens and their logprobs' float32 bits as JSON."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--dummy", action="store_true")
    ns = p.parse_args()
    from mindspeed_tp.integrations.vllm.engine import engine_env

    os.environ.update(engine_env(1))
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from mindspeed_tp.integrations.vllm.worker import pack_tensors

    llm = LLM(model=ns.model, load_format="dummy" if ns.dummy else "auto", enforce_eager=True, dtype="float32",
              worker_extension_cls="mindspeed_tp.integrations.vllm.worker.EngineInfo", block_size=128,
              enable_prefix_caching=False, max_model_len=64, seed=0)
    if ns.dummy:
        llm.collective_rpc("mindspeed_tp_load_weights",
                           args=(pack_tensors(load_file(os.path.join(ns.model, "model.safetensors")).items()),))
    out = llm.generate([TokensPrompt(prompt_token_ids=[5, 17, 3, 99, 42, 7, 8, 250])],
                       SamplingParams(max_tokens=8, temperature=0.0, logprobs=0))[0].outputs[0]
    bits = [int(torch.tensor(lp[t].logprob, dtype=torch.float32).view(torch.int32)) for t, lp in
            zip(out.token_ids, out.logprobs)]
    print("RELOAD " + json.dumps({"tokens": list(out.token_ids), "bits": bits,
                                  "logprobs": [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]}))


if __name__ == "__main__":
    main()
