"""The real vLLM engine's numerics (``vllm-cpu-*`` profiles, ``engine.name: vllm``): the rollout layout
with the installed engine's own kernels for every forward piece. Engine launch and weight sync:
``integrations/vllm/``.

strategy.py       the strategy (``VllmEngine``, a rollout layout)
forward.py        what each patched megatron-core piece computes under the engine, and why
kernels.py        the engine's own ops (imported from the installed vLLM wheel) inside autograd
                  Functions with a plain backward
host.py           which CPU kernels the installed vLLM selects on this host
expert_slices.py  the engine's MoE across Megatron's expert group
scoring.py        which positions of a scored sequence the engine computed as prefill or decode
refusals.py       settings under which the engine's arithmetic is not the one the profile describes

What ``numerics.ENGINES`` reads: the strategy class (no patch entries of its own).
"""
from .strategy import VllmEngine
