"""Parallel layouts (TP/SP/PP/EP/ETP, and for the training check DP/VPP) and the checks that make a
layout keep the contract."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..contract import refusals
from ..contract.refusals import refuse
from ..errors import ConfigError
from ..contract.profile import Profile
from .spec import ModelSpec

_TOKEN = re.compile(r"^(tp|pp|ep|etp|cp|dp|vpp)(\d+)$|^sp$")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    sp: bool = False
    ep: int = 1
    etp: int = 1
    # Context parallelism: each sequence cut into 2*cp chunks, rank r holding chunks r and 2*cp-1-r.
    cp: int = 1
    # Training check only (``mindspeed-tp train-check``): data-parallel replicas and virtual
    # pipeline chunks per stage. The scoring checker runs one replica per layout and no VPP.
    dp: int = 1
    vpp: int = 1

    @property
    def world_size(self) -> int:
        """Processes a training layout runs on: tp * cp * pp * dp (EP and ETP live inside it)."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    @property
    def required_world_size(self) -> int:
        """Megatron needs tp*cp*pp and etp*ep*pp to divide the world size."""
        a, b = self.tp * self.cp * self.pp, self.etp * self.ep * self.pp
        return a * b // math.gcd(a, b)

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}"]
        if self.sp:
            parts.append("sp")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.dp > 1:
            parts.append(f"dp{self.dp}")
        return "-".join(parts)

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Parse 'tp2-sp-pp2' style names (also 'tp2-pp2-vpp2', 'tp1-ep2-dp2', 'tp2-sp-cp2', 'cp2-dp2')."""
        sizes = {"tp": 1, "pp": 1, "ep": 1, "etp": 1, "cp": 1, "dp": 1, "vpp": 1}
        sp = False
        for token in text.strip().lower().split("-"):
            m = _TOKEN.match(token)
            if not m:
                raise ConfigError(
                    f"--layouts entry {text!r}: cannot read {token!r} (expected tpN, ppN, epN, etpN, cpN, dpN, vppN or sp)"
                )
            if token == "sp":
                sp = True
            else:
                sizes[m.group(1)] = int(m.group(2))
        return cls(sp=sp, **sizes)

    @classmethod
    def parse_training(cls, text: str) -> "Layout":
        """A training layout: one that names no dpN gets the DP replicas its expert grid needs
        (tp1-ep4 runs on 4 ranks, as megatron's DP is what the world leaves)."""
        layout = cls.parse(text)
        named_dp = any(token.startswith("dp") for token in text.strip().lower().split("-"))
        return layout if named_dp else layout.with_experts_dp()

    def with_experts_dp(self) -> "Layout":
        """The same layout with the fewest DP replicas that hold its expert grid (ep*etp dividing
        tp*cp*dp): the world megatron-core would need, for a training layout that names no dpN."""
        from dataclasses import replace

        ranks, experts = self.tp * self.cp, self.ep * self.etp
        return replace(self, dp=experts // math.gcd(ranks, experts))

    def without_cp(self) -> "Layout":
        """The same layout at CP = 1 (vanilla megatron's local attention cannot run CP)."""
        from dataclasses import replace

        return replace(self, cp=1)

    def cp_as_dp(self) -> "Layout":
        """The same world at CP = 1, the CP ranks as DP ranks (vanilla training, whose local attention
        cannot run CP, on the same processes)."""
        from dataclasses import replace

        return replace(self, cp=1, dp=self.dp * self.cp)

    def to_dict(self):
        out = {"tp": self.tp, "pp": self.pp, "sp": self.sp, "ep": self.ep, "etp": self.etp}
        if self.cp > 1:
            out["cp"] = self.cp
        if self.dp > 1 or self.vpp > 1:
            out.update(dp=self.dp, vpp=self.vpp)
        out["name"] = self.name
        return out


def _validate_mla(layout: Layout, spec: ModelSpec, profile: Profile) -> None:
    """MLA's column-parallel latents split by TP (megatron's local spec shards even the down projections)
    and cut into the canonical leaves; what it does not cover named before any process starts."""
    from ..compat import local_mla_query_projection_problem
    from ..contract.model_config import check_mla_profile

    mla = "multi_latent_attention"
    if layout.cp > 1:
        raise refuse(mla, setting="context_parallel_size", value=layout.cp, fix=f"drop cp{layout.cp} from the layout")
    check_mla_profile(profile)
    problem = local_mla_query_projection_problem() if spec.q_lora_rank is None else None
    if problem:
        raise refuse(mla, setting="q_lora_rank", value=None,
                     fix=f"{problem}; run this model on megatron-core 0.12-0.16, or with a query latent")
    n = spec.num_attention_heads
    sizes = [("kv_lora_rank+qk_pos_emb_head_dim", spec.kv_lora_rank + spec.qk_pos_emb_head_dim),
             ("num_attention_heads*(qk_head_dim+v_head_dim)", n * (spec.qk_head_dim + spec.v_head_dim)),
             ("num_attention_heads*v_head_dim", n * spec.v_head_dim)]
    if spec.q_lora_rank is not None:
        sizes.append(("q_lora_rank", spec.q_lora_rank))
    for what, size in sizes:
        for divisor, setting in ((layout.tp, "--tp"), (profile.canonical_shards, "canonical_shards")):
            if size % divisor:
                raise refuse("layout_size_indivisible", model=spec.name, what=what, size=size, setting=setting,
                             divisor=divisor)


def validate_layout(layout: Layout, spec: ModelSpec, profile: Profile, seq_length: int, training: bool = False) -> None:
    """Reject a layout that cannot be bitwise consistent, naming the setting to change.

    training: the layout is for ``mindspeed-tp train-check`` (dpN and vppN allowed)."""
    for flag, value in (("--tp", layout.tp), ("--pp", layout.pp), ("--ep", layout.ep), ("--etp", layout.etp),
                        ("--cp", layout.cp), ("dpN", layout.dp), ("vppN", layout.vpp)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if not training and (layout.dp > 1 or layout.vpp > 1):
        raise refuse("training_layout_in_checker", layout=layout.name)
    if layout.vpp > 1:
        if layout.pp < 2:
            raise refuse("vpp_without_pp", layout=layout.name)
        if spec.num_layers % (layout.pp * layout.vpp):
            raise refuse("vpp_layers_indivisible", model=spec.name, layers=spec.num_layers,
                         stages=layout.pp * layout.vpp)
    if training and spec.is_moe and (layout.tp * layout.cp * layout.dp) % (layout.ep * layout.etp):
        raise refuse("experts_outside_stage", layout=layout.name, experts=layout.ep * layout.etp,
                     ranks=layout.tp * layout.cp * layout.dp)
    profile.check_tp(layout.tp, setting="--tp (tensor_model_parallel_size)")
    if layout.sp and layout.tp == 1:
        raise refuse("sp_without_tp")
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
            raise refuse("layout_size_indivisible", model=spec.name, what=what, size=size, setting=setting,
                         divisor=divisor)
    spec.padded_vocab(profile)
    if spec.multi_latent_attention:
        _validate_mla(layout, spec, profile)
    if spec.is_moe:
        refusals.check_config(refusals.MOE, spec)  # the MoE settings MoELayer would refuse, named early
        if spec.num_experts % layout.ep:
            raise refuse("ep_indivisible", ep=layout.ep, experts=spec.num_experts, model=spec.name)
        profile.check_tp(layout.etp, setting="--etp (expert_tensor_parallel_size)")
        if spec.add_bias_linear and layout.etp > 1:  # megatron's own config asserts it later, unnamed
            raise refuse("moe_bias_expert_tp", etp=layout.etp)
        ffn = spec.moe_ffn_hidden_size or spec.ffn_hidden_size
        if ffn % profile.canonical_shards:  # checked early, in both modes, for the model's name
            raise refuse("moe_ffn_indivisible", ffn=ffn, c=profile.canonical_shards)
        if spec.moe_shared_expert_intermediate_size and spec.moe_shared_expert_intermediate_size % profile.canonical_shards:
            raise refuse("shared_expert_indivisible", model=spec.name, c=profile.canonical_shards)
        if layout.tp > 1 and layout.ep > 1 and not layout.sp:
            raise refuse("ep_tp_without_sp")
    elif layout.ep > 1 or layout.etp > 1:
        raise refuse("ep_without_moe", model=spec.name)
    if layout.sp and seq_length % layout.tp:
        raise refuse("sp_seq_indivisible", seq=seq_length, tp=layout.tp)
    if layout.cp > 1:
        multiple = 2 * layout.cp * (layout.tp if layout.sp else 1)
        if seq_length % multiple:
            raise refuse("cp_seq_indivisible", seq=seq_length, what="tp" if layout.sp else "1", multiple=multiple,
                         layout=layout.name, sp=" and sequence parallelism splits each rank's part over TP"
                         if layout.sp else "")
