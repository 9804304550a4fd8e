"""Prompts for the checker from a JSONL file: one prompt per line, as a list of token ids, an
object {"input_ids": [...]} or {"text": "..."}, or a JSON string (text). Text needs the tokenizer
of the checkpoint directory and the ``hf`` extra (transformers)."""
from __future__ import annotations

import json
import os
from typing import List, Optional

import torch

from ..errors import ConfigError
from ..models.spec import ModelSpec
from .batch import ScoringBatch

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _tokenizer(directory: Optional[str], path: str):
    if directory is None:
        raise ConfigError(f"--prompts {path}: text prompts need --hf-checkpoint with a tokenizer; "
                          f"or give token-id lists")
    # transformers would build an empty tokenizer from config.json alone; demand its files.
    if not any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_FILES):
        raise ConfigError(f"--prompts {path}: text prompts, but no usable tokenizer in {directory} (none of "
                          f"{list(_TOKENIZER_FILES)}); give token-id lists instead")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigError(f"--prompts {path}: text prompts need transformers: pip install 'mindspeed-tp[hf]'") from exc
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError variants for a missing tokenizer
        raise ConfigError(f"--prompts {path}: text prompts, but no usable tokenizer in {directory} ({exc}); "
                          f"give token-id lists instead") from exc


def load_prompts(path: str, spec: ModelSpec, hf_dir: Optional[str] = None) -> List[List[int]]:
    if not os.path.isfile(path):
        raise ConfigError(f"--prompts {path!r}: no such file")
    prompts, tokenizer = [], None
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--prompts {path}:{number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not JSON ({exc})") from exc
            if isinstance(item, dict) and "input_ids" in item:
                item = item["input_ids"]
            elif isinstance(item, dict) and "text" in item:
                item = item["text"]
            if isinstance(item, str):
                tokenizer = tokenizer or _tokenizer(hf_dir, path)
                item = tokenizer(item, add_special_tokens=False)["input_ids"]
            if not isinstance(item, list) or not item or not all(isinstance(t, int) for t in item):
                raise ConfigError(f"{where}: expected a non-empty list of token ids, {{\"input_ids\": [...]}} or "
                                  f"{{\"text\": ...}}")
            bad = [t for t in item if not 0 <= t < spec.vocab_size]
            if bad:
                raise ConfigError(f"{where}: token id(s) {bad[:5]} outside the vocabulary [0, {spec.vocab_size})")
            prompts.append(item)
    if not prompts:
        raise ConfigError(f"--prompts {path}: no prompts in the file")
    return prompts


def batch_from_prompts(prompts: List[List[int]], multiple: int, pad_id: int = 0) -> ScoringBatch:
    """Right-padded batch whose length is a multiple of ``multiple`` (every SP split divides)."""
    length = -(-max(len(p) for p in prompts) // multiple) * multiple
    tokens = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    return ScoringBatch(tokens=tokens, lengths=[len(p) for p in prompts])
