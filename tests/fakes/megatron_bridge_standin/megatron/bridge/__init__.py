"""Stand-in for Megatron-Bridge (see models/gpt_provider.py)."""
