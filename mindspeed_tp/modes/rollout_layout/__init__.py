"""The rollout-layout mode (profile ``reduction: rollout_layout``): training reproduces an
unmodified rollout engine running at TP=R, whatever its own layout.

- ``engine_math``: what the engine computes (its R row-parallel partials and all-reduce, one
  full-vocab fp32 log-softmax);
- ``linear``: the training side (input gathered along K, weights re-laid by output columns, the
  vocab exchanged in token chunks);
- ``relayout``: the re-laid weight cache, invalidated after every optimizer step.
"""
from ...patching import Hook, PatchRegistry
from .relayout import install_optimizer_hook


def register(reg: PatchRegistry) -> None:
    reg.add_hook(Hook(target="torch.optim.optimizer:register_optimizer_step_post_hook",
                      install=install_optimizer_hook, remove=lambda handle: handle.remove(),
                      reason="rollout_layout: an optimizer step invalidates the re-laid row-parallel weights"))
