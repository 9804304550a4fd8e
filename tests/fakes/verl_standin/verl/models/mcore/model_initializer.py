"""What verl's model initializer does for dense models (verl/models/mcore/model_initializer.py):
ask megatron-core for the Transformer Engine layer spec."""
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec


def dense_layer_spec(tfconfig):
    return get_gpt_decoder_block_spec(tfconfig, use_transformer_engine=True)
