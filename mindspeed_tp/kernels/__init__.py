"""Kernel interface: the kernels the patches call, written once over the backend primitives.

``dispatch`` picks the backend module (``backends/torch.py``, the CPU reference; ``backends/npu.py``)
per call from the profile's ``backend`` and the tensor's device; ``collectives`` moves data between
ranks and folds cross-rank sums in canonical order; ``context_parallel`` holds Megatron's CP chunk
layout and the key/value exchange of the consistent attention."""
from .attention import consistent_attention, decode_attention, packed_attention
from .linear import folded_leaf_partials, invariant_linear, invariant_matmul, leaf_partials
from .logprob import mask_padded_vocab, vocab_parallel_logprob
from .norm import layer_norm, rms_norm
from .rope import apply_rope, rope_angles, rope_inv_freq
from ..contract.tree import tree_fold

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
