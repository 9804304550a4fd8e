"""Worker (torchrun, 1 process): a DDP-wrapped model with its distributed optimizer, wired into its
config as train-check wires it, trained one step, then dropped. With ``release_models`` the DDP and
the optimizer are collected; without it they stay alive (the cycle through the optimizer's parameter
views and DDP's gradient hooks, which the collector cannot see). Dense under mindspeed-tp, and MoE
under vanilla megatron-core (its token dispatcher keeps the step's routing probabilities, whose graph
reaches DDP's hooks). Prints ``MODEL released|not released: FREED|ALIVE`` per case."""
import gc
import weakref

import torch

from mindspeed_tp import disable, enable
from mindspeed_tp.check.driver import (build_ddp_chunks, init_distributed, make_optimizer, micro_batch_rows,
                                       release_models, setup_parallel_state, teardown_parallel_state, wire_config)
from mindspeed_tp.check.settings import TrainSettings
from mindspeed_tp.check.train.loop import LossPass, train_batch
from mindspeed_tp.contract.profile import load_profile
from mindspeed_tp.devices.cpu_shims import install_cpu_shims
from mindspeed_tp.models.layout import Layout
from mindspeed_tp.models.spec import load_model_spec
from worker_exit import finish_worker


def trained_and_dropped(model: str, vanilla: bool, release: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec, layout, profile = load_model_spec(model), Layout(), load_profile()
    disable() if vanilla else enable(profile)
    settings = TrainSettings(steps=1, micro_batch_size=1, global_batch_size=2, seq_length=32,
                             distributed_optimizer=True)
    setup_parallel_state(layout, settings.seed, training=True)
    chunks, wrapped, ddp_config = build_ddp_chunks(spec, layout, torch.float32, profile, settings)
    optimizer = make_optimizer(wrapped, torch.float32, settings)
    wire_config(chunks[0].config, wrapped, ddp_config, optimizer)
    batch = train_batch(spec, settings)
    rows = micro_batch_rows(settings.global_batch_size, settings.micro_batch_size, 1, 0)
    LossPass(batch).run(get_forward_backward_func(), wrapped, rows, settings.micro_batch_size, forward_only=False)
    optimizer.step()
    refs = [weakref.ref(wrapped[0]), weakref.ref(optimizer)]
    if release:
        release_models(wrapped, chunks[0].config)
    del chunks, wrapped, optimizer
    teardown_parallel_state()
    disable()
    return refs


init_distributed()
install_cpu_shims()
for model, vanilla in (("tiny-dense", False), ("tiny-moe", True)):
    for release in (True, False):
        refs = trained_and_dropped(model, vanilla, release)
        gc.collect()
        state = "FREED" if all(r() is None for r in refs) else "ALIVE"
        print(f"{model} {'released' if release else 'not released'}: {state}", flush=True)
finish_worker()
