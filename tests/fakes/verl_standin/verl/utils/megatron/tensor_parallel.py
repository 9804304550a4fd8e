"""verl's Megatron logprob (verl/utils/megatron/tensor_parallel.py): minus Megatron's
vocab-parallel cross entropy."""


def vocab_parallel_log_probs_from_logits(logits, labels):
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits=logits, target=labels)
