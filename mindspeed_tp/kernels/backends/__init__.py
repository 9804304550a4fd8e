"""Kernel backends, one module each, implementing the same primitives (``kernels/dispatch.py``):
``torch`` (the reference, CPU), ``npu`` (CANN batch-invariant ops, Ascend flash attention),
``triton`` (fixed-tile Triton kernels, CUDA; the kernels themselves in ``triton_kernels``)."""
