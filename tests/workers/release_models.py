"""Worker (torchrun, 1 process): a DDP-wrapped model with its distributed optimizer, wired into its
config as train-check wires it, trained one step, then dropped. With ``release_models`` the DDP and
the optimizer are collected; without it they stay alive (the cycle through the optimizer's parameter
views and DDP's gradient hooks, which the collector cannot see). Dense under mindspeed-tp, and MoE
under vanilla megatron-core (its token dispatcher keeps the step's routing probabilities, whose graph
reaches DDP's hooks). Prints ``MODEL released|not released: FREED|ALIVE`` per case."""
import gc
import weakref
from functools import partial

import torch

from mindspeed_tp import disable, enable
from mindspeed_tp.check.harness import _setup_parallel_state, _teardown_parallel_state, init_distributed
from mindspeed_tp.check.train.loop import (TrainSettings, _data, _forward_step, _LossRecorder, make_optimizer,
                                           micro_batch_rows, model_parallel_chunks, release_models, train_batch,
                                           wire_config)
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
    _setup_parallel_state(layout, settings.seed, training=True)
    chunks, wrapped, ddp_config = model_parallel_chunks(spec, layout, torch.float32, profile, settings)
    optimizer = make_optimizer(wrapped, torch.float32, settings)
    wire_config(chunks[0].config, wrapped, ddp_config, optimizer)
    batch, rows = train_batch(spec, settings), micro_batch_rows(settings, 1, 0)
    get_forward_backward_func()(
        forward_step_func=partial(_forward_step, _LossRecorder(settings.seq_length)), data_iterator=_data(batch, rows),
        model=wrapped[0], num_microbatches=len(rows), seq_length=settings.seq_length, micro_batch_size=1,
        decoder_seq_length=settings.seq_length, forward_only=False)
    optimizer.step()
    refs = [weakref.ref(wrapped[0]), weakref.ref(optimizer)]
    if release:
        release_models(wrapped, chunks[0].config)
    del chunks, wrapped, optimizer
    _teardown_parallel_state()
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
