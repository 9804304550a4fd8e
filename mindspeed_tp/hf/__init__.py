"""Hugging Face checkpoints (Qwen3, Qwen3-MoE): config, loading any layout's shards, export."""
from .checkpoint import SafetensorsCheckpoint
from .config import hf_config_from_spec, read_hf_config, spec_from_hf_config
from .export import export_hf_checkpoint, megatron_to_hf
from .source import HFWeights, open_hf_model, validate_tensors

__all__ = ["SafetensorsCheckpoint", "HFWeights", "open_hf_model", "validate_tensors", "spec_from_hf_config",
           "read_hf_config", "hf_config_from_spec", "export_hf_checkpoint", "megatron_to_hf"]
