"""Shared by the gradient workers (run under torchrun with this directory on sys.path).

Gradients go through megatron-core's own machinery: the model is wrapped in its
DistributedDataParallel (whose hooks accumulate each gradient into ``main_grad``), and
``finalize_model_grads`` reduces them (over DP, the SP-replicated norms over TP, embeddings over PP).
"""
from mindspeed_tp.check.driver import logprobs_from_logits, pipeline_forward


def scored_loss(model, layout, batch, spec, dtype):
    """Mean negative logprob of the batch's scored tokens (the training objective's shape)."""
    scored = batch.scored.float()
    logits = pipeline_forward(model, layout, batch, spec.hidden_size, dtype)
    return -(logprobs_from_logits(logits, batch, spec.vocab_size) * scored).sum() / scored.sum()


def with_ddp(model):
    """megatron's DDP around ``model`` (fp32 gradient buffer, no overlap); forward through ``model``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), module=model)


def finalize_grads(ddp):
    """megatron's finalize_model_grads; returns the reduced gradients by parameter name."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp])
    return {name: p.main_grad.detach().clone() for name, p in ddp.module.named_parameters()}


def zero_grads(ddp) -> None:
    ddp.zero_grad_buffer()
    for p in ddp.module.parameters():
        p.grad = None


def as_param_grads(ddp, grads) -> None:
    """The reduced gradients as ``.grad`` (in each parameter's dtype), for a torch.optim optimizer."""
    for name, p in ddp.module.named_parameters():
        p.grad = grads[name].to(p.dtype)
