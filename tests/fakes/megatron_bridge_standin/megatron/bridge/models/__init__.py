"""Stand-in for megatron.bridge.models (see gpt_provider.py)."""
