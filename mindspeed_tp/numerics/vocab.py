"""The true (unpadded) vocabulary size the logprob and the LM head's bitwise backward exclude
Megatron's padded columns by."""
from .. import state
from ..contract.refusals import refuse


def true_vocab_size(padded: int) -> int:
    """The true vocab size: the explicit setting (``mindspeed_tp.set_vocab_size``,
    ``MINDSPEED_TP_VOCAB_SIZE``, ``--true-on-policy-vocab-size``), else the ``vocab_size`` of the
    config of the model computing its loss. Unknown: refused, since Megatron pads to a TP-dependent
    size and padded columns inside the softmax make every logprob depend on TP."""
    explicit, from_model = state.explicit_vocab_size(), state.model_vocab()
    if explicit is not None and from_model is not None and explicit != from_model:
        raise refuse("vocab_size_conflict", explicit=explicit, model=from_model)
    size = explicit if explicit is not None else from_model
    if size is None:
        raise refuse("vocab_size_unknown", padded=padded)
    if size > padded:
        raise refuse("vocab_size_exceeds_logits", vocab=size, padded=padded)
    return size
