"""Shared by the gradient workers (run under torchrun with this directory on sys.path)."""
import torch.distributed as dist

from mindspeed_tp.check.harness import _logprobs_from_logits, _pipeline_forward


def scored_loss(model, layout, batch, spec, dtype):
    """Mean negative logprob of the batch's scored tokens (the training objective's shape)."""
    scored = batch.scored.float()
    logits = _pipeline_forward(model, layout, batch, spec.hidden_size, dtype)
    return -(_logprobs_from_logits(logits, batch, spec.vocab_size) * scored).sum() / scored.sum()


def finalize_grads(model):
    """What Megatron's finalize_model_grads does for SP-replicated params (norms): sum over TP."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)
