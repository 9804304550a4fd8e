"""Several ranks on one GPU: collectives of CUDA tensors staged through host memory over gloo.

No GPU here: the staging is exercised on CPU tensors (staged as if they were device tensors, so
every result reaches the caller only through the wrapper's copy back), and ``--device cuda``
without CUDA must be a clear usage error. That NCCL-free runs on a real shared GPU give the
checker's bitwise results is for scripts/device_check.sh to show.
"""

from conftest import explain, run_python, run_torchrun

from mindspeed_tp.check.host_staging import ranks_share_a_device


def test_every_staged_collective_writes_back_its_result():
    proc = run_torchrun("host_staging.py", 2, timeout=180)
    assert proc.returncode == 0, explain(proc)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(("OK ", "BAD "))]
    assert len(lines) == 2 * 13, explain(proc)
    assert all(l.startswith("OK ") for l in lines), "\n".join(l for l in lines if l.startswith("BAD "))


def test_ranks_share_a_device_when_more_local_ranks_than_gpus():
    assert ranks_share_a_device(8, 1) and ranks_share_a_device(2, 1)
    assert not ranks_share_a_device(1, 1) and not ranks_share_a_device(8, 8)


def test_device_cuda_without_cuda_is_a_usage_error():
    proc = run_python("import sys; from mindspeed_tp.check.main import main; "
                      "sys.exit(main(['--device', 'cuda', '--model', 'tiny-dense', '--tp', '1']))")
    assert proc.returncode == 2, explain(proc)
    assert "--device cuda" in proc.stderr and "torch.cuda.is_available() is False" in proc.stderr, explain(proc)
