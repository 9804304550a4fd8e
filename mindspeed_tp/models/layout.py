"""Parallel layouts (TP/SP/PP) and the checks that make a layout keep the contract."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError
from ..profile import Profile
from .spec import ModelSpec

_TOKEN = re.compile(r"^(tp|pp)(\d+)$|^sp$")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    sp: bool = False

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}"]
        if self.sp:
            parts.append("sp")
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        return "-".join(parts)

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Parse 'tp2-sp-pp2' style names."""
        tp, pp, sp = 1, 1, False
        for token in text.strip().lower().split("-"):
            m = _TOKEN.match(token)
            if not m:
                raise ConfigError(f"--layouts entry {text!r}: cannot read {token!r} (expected tpN, ppN or sp)")
            if token == "sp":
                sp = True
            elif m.group(1) == "tp":
                tp = int(m.group(2))
            else:
                pp = int(m.group(2))
        return cls(tp=tp, pp=pp, sp=sp)

    def to_dict(self):
        return {"tp": self.tp, "pp": self.pp, "sp": self.sp, "name": self.name}


def validate_layout(layout: Layout, spec: ModelSpec, profile: Profile, seq_length: int) -> None:
    """Reject a layout that cannot be bitwise consistent, naming the setting to change."""
    if layout.tp < 1 or layout.pp < 1:
        raise ConfigError(f"--tp and --pp must be >= 1, got tp={layout.tp} pp={layout.pp}")
    profile.check_tp(layout.tp, setting="--tp (tensor_model_parallel_size)")
    if layout.sp and layout.tp == 1:
        raise ConfigError("--sp (sequence parallel) needs --tp > 1")
    checks = [
        ("num_attention_heads", spec.num_attention_heads, layout.tp, "--tp"),
        ("num_query_groups", spec.num_query_groups, layout.tp, "--tp"),
        ("ffn_hidden_size", spec.ffn_hidden_size, profile.canonical_shards, "canonical_shards"),
        ("num_attention_heads*kv_channels", spec.num_attention_heads * spec.kv_channels,
         profile.canonical_shards, "canonical_shards"),
        ("num_layers", spec.num_layers, layout.pp, "--pp"),
    ]
    for what, size, divisor, setting in checks:
        if size % divisor:
            raise ConfigError(
                f"model {spec.name}: {what}={size} is not divisible by {setting}={divisor}; change {setting} "
                f"or the model size"
            )
    spec.padded_vocab(profile)
    if layout.sp and seq_length % layout.tp:
        raise ConfigError(f"--seq-length={seq_length} is not divisible by --tp={layout.tp} (needed for --sp)")
