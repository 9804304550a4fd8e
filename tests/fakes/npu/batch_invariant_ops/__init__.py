"""Stand-in for CANN's batch_invariant_ops torch extension: defines the four custom ops under
torch.ops.batch_invariant_ops with the argument lists MindSpeed core_r0.16.0 calls them with,
records every call in CALLS and computes the plain torch result."""
import torch

_SCHEMAS = {
    "npu_mm_batch_invariant": ("npu_mm_batch_invariant(Tensor a, Tensor b) -> Tensor", lambda a, b: torch.mm(a, b)),
    "npu_matmul_batch_invariant": ("npu_matmul_batch_invariant(Tensor a, Tensor b) -> Tensor",
                                   lambda a, b: torch.matmul(a, b)),
    "npu_reduce_sum_batch_invariant": ("npu_reduce_sum_batch_invariant(Tensor x, int dim, bool keepdim) -> Tensor",
                                       lambda x, dim, keepdim: torch.sum(x, dim, keepdim=keepdim)),
    "npu_log_softmax_batch_invariant": ("npu_log_softmax_batch_invariant(Tensor x, int dim) -> Tensor",
                                        lambda x, dim: torch.log_softmax(x, dim)),
}

# The op library lives as long as the process (an op can be defined once); CALLS survives re-imports.
_state = getattr(torch, "_fake_batch_invariant_ops", None)
if _state is None:
    _state = {"calls": []}
    lib = torch.library.Library("batch_invariant_ops", "DEF")
    for name, (schema, fn) in _SCHEMAS.items():
        lib.define(schema)

        def impl(*args, _name=name, _fn=fn):
            _state["calls"].append((_name, args))
            return _fn(*args)

        lib.impl(name, impl, "CPU")
    _state["lib"] = lib
    torch._fake_batch_invariant_ops = _state
CALLS = _state["calls"]
