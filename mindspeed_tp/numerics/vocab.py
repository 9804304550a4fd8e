"""The true (unpadded) vocabulary size the logprob and the LM head's bitwise backward exclude
Megatron's padded columns by."""
from .. import state
from ..contract.refusals import refuse


def true_vocab_size(padded: int, from_model=None) -> int:
    """The true vocab size: the explicit setting (``mindspeed_tp.set_vocab_size``,
    ``MINDSPEED_TP_VOCAB_SIZE``, ``--true-on-policy-vocab-size``), else what the model states
    (``from_model``: the mark its logits carry; default the model running its forward or loss: its
    mark or its config's ``vocab_size``). Unknown: refused, since Megatron pads to a TP-dependent
    size and padded columns inside the softmax make every logprob depend on TP."""
    explicit = state.explicit_vocab_size()
    from_model = from_model if from_model is not None else state.model_vocab()
    if explicit is not None and from_model is not None and explicit != from_model:
        raise refuse("vocab_size_conflict", explicit=explicit, model=from_model)
    size = explicit if explicit is not None else from_model
    if size is None:
        raise refuse("vocab_size_unknown", padded=padded)
    if size > padded:
        raise refuse("vocab_size_exceeds_logits", vocab=size, padded=padded)
    return size
