"""Runs inside the engine's workers (``worker_extension_cls``): what the engine chose, for the report."""


class EngineInfo:
    """Mixed into vLLM's worker class; called through ``LLM.collective_rpc`` by name (no pickle)."""

    def mindspeed_tp_engine_info(self):
        from .kernels import describe_engine_model

        return describe_engine_model(self.model_runner.model, self.vllm_config)
