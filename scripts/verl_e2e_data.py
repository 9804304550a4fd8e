"""The inputs of a verl GRPO run built offline: a tiny Qwen3 checkpoint written by transformers, its
word-level tokenizer with a chat template, prompts in parquet (verl's RL dataset columns) and a
verifiable reward function.

    python scripts/verl_e2e_data.py OUT [--prompts 256]

writes OUT/model (checkpoint + tokenizer), OUT/train.parquet, OUT/val.parquet and OUT/reward.py
(``compute_score``: the share of the response's words with an even index).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant", "\n")  # a newline is one token, as in Qwen's ChatML (verl relies on it)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REWARD = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the response's words with an even index (w0, w2, ...): a verifiable reward that varies
    between samples of the tiny random policy, so GRPO's advantages and the update are not zero."""
    words = [w for w in solution_str.split() if w[:1] == "w" and w[1:].isdigit()]
    return sum(int(w[1:]) % 2 == 0 for w in words) / len(words) if words else 0.0
'''


def save_tokenizer(directory: str, vocab_size: int) -> None:
    """Words w0.. plus the chat roles, a newline and three special tokens: exactly ``vocab_size`` entries,
    so that ``len(tokenizer) == vocab_size`` (verl and vLLM both check the model's vocab against it)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_size - len(SPECIALS) - len(ROLES))]
    vocab = {w: i for i, w in enumerate([*words, *ROLES, *SPECIALS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens([AddedToken("\n", normalized=False, special=False)])  # matched before the whitespace split
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    fast.save_pretrained(directory)


def save_model(directory: str, vocab_size: int, seed: int) -> None:
    """The tests' tiny sharpened Qwen3 (``tests/hf_models.make_qwen3``, written by transformers) at head dim
    32 (a size vLLM's CPU attention has), its vocab the tokenizer's, its special tokens the chat ones."""
    from hf_models import make_qwen3

    make_qwen3(directory, seed=seed, vocab_size=vocab_size, hidden_size=128, intermediate_size=256, head_dim=32,
               eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 3, bos_token_id=None)


def save_prompts(path: str, count: int, words: int, seed: int) -> None:
    """verl's RL dataset rows: a chat prompt of random words, its words as the ground truth."""
    import pandas as pd

    rng = random.Random(seed)
    rows = []
    for i in range(count):
        text = " ".join(f"w{rng.randrange(words)}" for _ in range(rng.randrange(6, 20)))
        rows.append({"data_source": "mindspeed_tp/even-words", "ability": "parity",
                     "prompt": [{"role": "user", "content": text}],
                     "reward_model": {"style": "rule", "ground_truth": text},
                     "extra_info": {"index": i}})
    pd.DataFrame(rows).to_parquet(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    model = os.path.join(ns.out, "model")
    os.makedirs(model, exist_ok=True)
    save_model(model, ns.vocab_size, ns.seed)
    save_tokenizer(model, ns.vocab_size)
    words = ns.vocab_size - len(SPECIALS) - len(ROLES)
    save_prompts(os.path.join(ns.out, "train.parquet"), ns.prompts, words, ns.seed)
    save_prompts(os.path.join(ns.out, "val.parquet"), 16, words, ns.seed + 1)
    with open(os.path.join(ns.out, "reward.py"), "w") as f:
        f.write(REWARD)
    print(json.dumps({"model": model, "train": os.path.join(ns.out, "train.parquet")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
