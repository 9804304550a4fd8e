"""Bad settings exit 2 with a message naming the setting -- before any process is launched where
possible, and never by silently running the non-invariant path."""
import pytest

from conftest import explain, run_cli, run_torchrun


def _model_file(tmp_path, **overrides):
    import yaml

    from mindspeed_tp.models.spec import load_model_spec

    data = load_model_spec("tiny-dense").to_dict()
    data.update(name="custom", **overrides)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--tp", "3"], "--tp"),
        (["--tp", "16"], "canonical_shards"),
        (["--tp", "1", "--sp"], "--sp"),
        (["--model", "no-such-model"], "--model"),
        (["--profile", "no-such-profile"], "profile"),
        (["--pp", "3"], "--pp"),
        (["--tp", "2", "--sp", "--seq-length", "33"], "--seq-length"),
        (["--layouts", "tp2,zz9"], "--layouts"),
        (["--no-such-flag"], "unrecognized"),
    ],
)
def test_bad_flags_exit_2_naming_the_setting(args, needle):
    proc = run_cli("check", *args)
    assert proc.returncode == 2, explain(proc)
    assert needle in proc.stderr, explain(proc)


def test_hidden_size_that_does_not_divide(tmp_path):
    proc = run_cli("check", "--model", _model_file(tmp_path, ffn_hidden_size=100), "--tp", "2")
    assert proc.returncode == 2, explain(proc)
    assert "ffn_hidden_size=100" in proc.stderr and "canonical_shards" in proc.stderr


def test_heads_that_do_not_divide_by_tp(tmp_path):
    proc = run_cli("check", "--model", _model_file(tmp_path, num_query_groups=2), "--tp", "4")
    assert proc.returncode == 2, explain(proc)
    assert "num_query_groups=2" in proc.stderr


def test_vocab_that_does_not_divide(tmp_path):
    proc = run_cli("check", "--model", _model_file(tmp_path, padded_vocab_size=1001), "--tp", "2")
    assert proc.returncode == 2, explain(proc)
    assert "padded_vocab_size=1001" in proc.stderr


def test_bad_profile_field(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("canonical_shards: 6\n")
    proc = run_cli("check", "--profile", str(path))
    assert proc.returncode == 2, explain(proc)
    assert "canonical_shards" in proc.stderr


def test_profile_that_differs_between_ranks(tmp_path):
    proc = run_torchrun("profile_mismatch.py", 2, str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    assert (tmp_path / "code0").read_text() == "2" and (tmp_path / "code1").read_text() == "2"
    assert "ranks disagree on profile" in proc.stderr, explain(proc)
