"""What verl's MegatronPPOActor.compute_log_prob does with the LM head's vocab-parallel logits
(its logits_processor closure): divide by the temperature in place, call the logprob function
imported by name, zero the masked labels."""
from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_from_logits


def logits_processor(logits, label, label_mask, temperature):
    logits.div_(temperature)
    log_probs = vocab_parallel_log_probs_from_logits(logits, label)
    return log_probs.masked_fill(~label_mask, 0.0)
