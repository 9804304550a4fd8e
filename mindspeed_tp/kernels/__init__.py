"""Kernel interface. The torch reference backend (CPU, always tested) implements every kernel;
the npu backend (``kernels/npu.py``: CANN batch-invariant ops, Ascend flash attention) runs behind
the same names when ``backends.use_npu`` selects it for a call."""
from .attention import consistent_attention, decode_attention, packed_attention
from .linear import folded_leaf_partials, invariant_linear, invariant_matmul, leaf_partials
from .logprob import mask_padded_vocab, vocab_parallel_logprob
from .norm import layer_norm, rms_norm
from .rope import apply_rope, rope_angles, rope_inv_freq
from ..tree import tree_fold

__all__ = [
    "apply_rope",
    "consistent_attention",
    "decode_attention",
    "folded_leaf_partials",
    "invariant_linear",
    "invariant_matmul",
    "layer_norm",
    "mask_padded_vocab",
    "packed_attention",
    "leaf_partials",
    "rms_norm",
    "rope_angles",
    "rope_inv_freq",
    "tree_fold",
    "vocab_parallel_logprob",
]
