"""The rollout-layout strategy's patch entries (also an engine profile's: the vLLM strategy is a
rollout layout): the weight caches derived from weights (``relayout.py``, the engine's prepacked
ones) are invalidated after an optimizer step or a checkpoint load (``numerics/weight_caches.py``)."""
from ...patching import Hook, Patch, PatchRegistry
from ..weight_caches import invalidating
from .relayout import install_optimizer_hook


def register(reg: PatchRegistry) -> None:
    reg.add_hook(Hook(target="torch.optim.optimizer:register_optimizer_step_post_hook",
                      install=install_optimizer_hook, remove=lambda handle: handle.remove(),
                      reason="rollout_layout: an optimizer step invalidates the re-laid row-parallel weights"))
    why = "rollout_layout / engine profiles: the re-laid and prepacked weight caches are invalidated after "
    reg.add(Patch(target="torch.nn.modules.module:Module.load_state_dict", replacement=invalidating, wraps=True,
                  reason=why + "a state dict is loaded"))
    reg.add(Patch(target="megatron.core.dist_checkpointing.serialization:load", replacement=invalidating,
                  wraps=True, reason=why + "a distributed checkpoint is loaded (into existing tensors)"))
    # mbridge's load_weights: integrations/verl.py (applied when mbridge is imported)
