"""``mindspeed-tp train-check``: the patches inside megatron-core's own training machinery (DDP, the
(distributed) optimizer, the pipeline schedules, finalize_model_grads), compared step by step with
the same training on one device. ``main.py`` flags and flow, ``loop.py`` the training run,
``report.py`` reference file, rows, table and JSON."""
