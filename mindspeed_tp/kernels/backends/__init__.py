"""Kernel backends, one module each, implementing the same primitives (``kernels/dispatch.py``):
``torch`` (the reference, CPU), ``npu`` (CANN batch-invariant ops, Ascend flash attention)."""
