"""Facts about a built megatron-core model that its modules do not carry, set on its parameters
at construction (GPTModel, the norm patch) for any strategy that needs them:

- ``OUTPUT_PARTS_ATTR``: a gated MLP's fc1 holds [gate_r; up_r] on each rank (2 parts);
- ``TIED_HEAD_ATTR``: the word embedding whose weight the LM head shares on this stage (PP=1);
- ``PER_TOKEN_PARAM_ATTR``: a parameter of a per-token layer (RMSNorm / LayerNorm, QK-norm), a MoE
  router or a row-parallel layer's bias, whose gradient is a sum over tokens (bitwise training folds it across TP in the backward);
- ``MLA_KV_UP_ATTR``: multi-latent attention's kv up projection (vLLM multiplies it by plain
  ``F.linear``, outside its CPU GEMM dispatch);
- ``TRUE_VOCAB_ATTR``: the true (unpadded) vocabulary of a GPTModel whose builder knows it (mbridge
  pads to ``make_vocab_size_divisible_by``), and of the logits its forward returns, so a logprob
  computed outside the model's loss (verl) excludes the padded columns.
"""
OUTPUT_PARTS_ATTR = "_mindspeed_tp_output_parts"
TIED_HEAD_ATTR = "_mindspeed_tp_tied_head"
PER_TOKEN_PARAM_ATTR = "_mindspeed_tp_per_token_param"
TRUE_VOCAB_ATTR = "_mindspeed_tp_true_vocab"
MLA_KV_UP_ATTR = "_mindspeed_tp_mla_kv_up"


def mark_gated_fc1(model) -> None:
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        # a dense MLP's or a MoE layer's shared experts' (a dense MLP too); routed experts are told apart
        # by the MoE path itself
        if name.endswith(("mlp.linear_fc1", "shared_experts.linear_fc1")) and getattr(config, "gated_linear_unit", False):
            setattr(module.weight, OUTPUT_PARTS_ATTR, 2)


def mark_mla_kv_up(model) -> None:
    for name, module in model.named_modules():
        if name.endswith("self_attention.linear_kv_up_proj"):
            setattr(module.weight, MLA_KV_UP_ATTR, True)


def mark_tied_head(model) -> None:
    if getattr(model, "share_embeddings_and_output_weights", False) and getattr(model, "pre_process", False) \
            and getattr(model, "post_process", False):
        setattr(model.embedding.word_embeddings.weight, TIED_HEAD_ATTR, True)


def mark_per_token_params(module) -> None:
    for p in module.parameters():
        setattr(p, PER_TOKEN_PARAM_ATTR, True)


def mark_routers(model) -> None:
    """A MoE router's weight (replicated over TP; its gradient a sum over the micro-batch's tokens)."""
    for name, module in model.named_modules():
        if name.endswith("mlp.router"):
            mark_per_token_params(module)


def mark_row_parallel_biases(model) -> None:
    """A row-parallel layer's bias (attention's linear_proj, an MLP's linear_fc2: add_bias_linear), added
    to every token's output row, so its gradient is a sum over tokens (megatron all-reduces it over TP
    under SP; bitwise training folds it across TP in the backward)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    for module in model.modules():
        if isinstance(module, RowParallelLinear) and getattr(module, "bias", None) is not None:
            setattr(module.bias, PER_TOKEN_PARAM_ATTR, True)


def mark_expert_biases(model) -> None:
    """An expert's fc2 bias (gpt-oss; megatron builds experts' biases at expert TP 1 only) is its
    expert's alone, as its weight is, but megatron marks only the weight ``tensor_model_parallel``: the
    optimizers' gradient norm then counts the bias on attention-TP rank 0 only, whose other ranks hold
    other experts under EP, so the norm (and the clipping) depended on the layout. Marked as its
    weight is (megatron's own convention for an unsplit parameter every TP rank holds apart, as
    Mamba's ``dt_bias``), it is counted once in every layout."""
    for name, module in model.named_modules():
        bias = getattr(module, "bias", None)
        if ".local_experts." in name and name.endswith("linear_fc2") and bias is not None:
            bias.tensor_model_parallel = True


def mark_true_vocab(model, vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"a true vocab size must be a positive integer, got {vocab_size!r}")
    setattr(model, TRUE_VOCAB_ATTR, vocab_size)


def true_vocab_of(model):
    """The model's true vocab: its mark, else its config's ``vocab_size`` (Megatron-Bridge), else None."""
    return getattr(model, TRUE_VOCAB_ATTR, None) or config_true_vocab(getattr(model, "config", None),
                                                                      getattr(model, "vocab_size", None))


def config_true_vocab(config, columns):
    """A config's ``vocab_size`` as the true vocab, where it can be one: smaller than the ``columns``
    the model's embedding and LM head hold (the padded size). Equal to them it is ambiguous (a
    framework storing the padded size there looks the same as an unpadded vocabulary): None, so the
    explicit setting is needed (``vocab_size_unknown`` names it) instead of padded columns entering
    the log-softmax."""
    stated = getattr(config, "vocab_size", None)
    if stated is None or (columns is not None and int(stated) >= int(columns)):
        return None
    return int(stated)
