"""Facts about a built megatron-core model that its modules do not carry, set on its parameters
at construction (GPTModel, the norm patch) for any strategy that needs them:

- ``OUTPUT_PARTS_ATTR``: a gated MLP's fc1 holds [gate_r; up_r] on each rank (2 parts);
- ``TIED_HEAD_ATTR``: the word embedding whose weight the LM head shares on this stage (PP=1);
- ``PER_TOKEN_PARAM_ATTR``: a parameter of a per-token layer (RMSNorm / LayerNorm, QK-norm), whose
  gradient is a sum over tokens (bitwise training folds it across TP in the backward).
"""
OUTPUT_PARTS_ATTR = "_mindspeed_tp_output_parts"
TIED_HEAD_ATTR = "_mindspeed_tp_tied_head"
PER_TOKEN_PARAM_ATTR = "_mindspeed_tp_per_token_param"


def mark_gated_fc1(model) -> None:
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if name.endswith("mlp.linear_fc1") and getattr(config, "gated_linear_unit", False):
            setattr(module.weight, OUTPUT_PARTS_ATTR, 2)


def mark_tied_head(model) -> None:
    if getattr(model, "share_embeddings_and_output_weights", False) and getattr(model, "pre_process", False) \
            and getattr(model, "post_process", False):
        setattr(model.embedding.word_embeddings.weight, TIED_HEAD_ATTR, True)


def mark_per_token_params(module) -> None:
    for p in module.parameters():
        setattr(p, PER_TOKEN_PARAM_ATTR, True)
