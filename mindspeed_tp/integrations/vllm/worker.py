"""Runs inside the engine's workers (``worker_extension_cls``), called through
``LLM.collective_rpc`` by method name (no pickled code): the engine's report, and the in-memory
weight sync."""


def pack_tensors(named_tensors):
    """(name, tensor) -> (name, dtype, shape, bytes): what survives the engine's RPC on every path
    (its msgpack transport decodes large tensors as views of the message buffer, which its
    multiprocess executor then cannot pickle; plain bytes it copies)."""
    import torch

    out = []
    for name, t in named_tensors:
        t = t.detach().contiguous().cpu()
        out.append((name, str(t.dtype).removeprefix("torch."), list(t.shape),
                    t.view(-1).view(torch.uint8).numpy().tobytes()))
    return out


def unpack_tensors(packed):
    import torch

    return [(name, torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(getattr(torch, dtype)).view(shape))
            for name, dtype, shape, blob in packed]


class EngineInfo:
    """Mixed into vLLM's worker class."""

    def mindspeed_tp_engine_info(self):
        from ...numerics.vllm.kernels import describe_engine_model

        return describe_engine_model(self.model_runner.model, self.vllm_config)

    def mindspeed_tp_load_weights(self, packed):
        """HF-name tensors into this worker's model by vLLM's in-place ``reload_weights`` (the
        model's own loader shards them for this TP rank and redoes the post-load processing, e.g.
        the CPU GEMM prepacking)."""
        reload_in_place(self, unpack_tensors(packed))
        return len(packed)


def reload_in_place(worker, named_tensors) -> None:
    """HF-name tensors into the worker's model by vLLM's ``reload_weights``, then what vLLM 0.32's
    layerwise reload leaves behind on CPU: the CPU experts' prepacking (``prepack_cpu_experts_again``) and
    a tied LM head (``tied_lm_heads_again``)."""
    model = worker.model_runner.model
    ties = tied_lm_heads(model)
    worker.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
    prepack_cpu_experts_again(model)
    tied_lm_heads_again(ties)


def tied_lm_heads(model):
    """(LM head, embedding) pairs sharing one weight (``tie_word_embeddings``)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeddings = [m for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    return [(head, emb) for head in model.modules() if isinstance(head, ParallelLMHead)
            for emb in embeddings if head.weight is emb.weight]


def tied_lm_heads_again(ties) -> int:
    """vLLM 0.32: a tied LM head keeps the weight it had before a reload (the checkpoint has no
    ``lm_head.weight``, so the layerwise reload never finishes that layer: the head still holds the old
    parameter and its CPU GEMM the old prepacked copy; measured: logprobs of a uniform policy after a
    reload into a dummy-initialised engine). Tie it to the reloaded embedding and redo its post-load
    processing (the CPU GEMM prepacking), vLLM's own step."""
    for head, embedding in ties:
        head.weight = embedding.weight
        head.quant_method.process_weights_after_loading(head)
    return len(ties)


def prepack_cpu_experts_again(model) -> int:
    """vLLM 0.32: on a weight update its unquantized MoE method skips the experts' own
    ``process_weights_after_loading`` (UnquantizedFusedMoEMethod._setup_kernel runs it on the first
    load only), so the CPU experts keep the reloaded weights unpacked while ``cpu_fused_moe`` reads
    them as prepacked (measured: a reload of the same weights changed every logprob). Run that step
    of the engine's own for each CPU experts layer; vLLM itself is not modified."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    done = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            done += 1
    return done
