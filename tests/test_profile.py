"""The numerics profile: loading, validation (ConfigError naming the field), TP checks, digest."""
import dataclasses

import pytest
import yaml

from mindspeed_tp.errors import ConfigError
from mindspeed_tp.contract.profile import Profile, load_profile, profile_from_dict


def _write(tmp_path, data, name="p.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_load_default():
    p = load_profile()
    assert isinstance(p, Profile)
    assert p.name == "default"
    assert p.canonical_shards == 8
    assert p.attention_block_size == 128
    assert p.gemm_row_multiple == 16
    assert p.vocab_pad_multiple == 128
    assert p.reduction == "canonical_tree"
    assert p.accumulate_dtype == "float32" and p.logits_dtype == "float32"
    assert load_profile("default") == p
    assert load_profile("") == p
    assert p == Profile()  # the bundled file states the dataclass defaults
    assert load_profile(p) is p


def test_load_from_yaml_path(tmp_path):
    path = _write(tmp_path, {"name": "small", "canonical_shards": 4, "attention_block_size": 16})
    p = load_profile(path)
    assert p.name == "small"
    assert p.canonical_shards == 4
    assert p.attention_block_size == 16
    assert p.gemm_row_multiple == 16  # unspecified fields keep their defaults
    assert p != load_profile()


def test_load_empty_yaml_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_profile(str(path)) == Profile()


BAD_FIELDS = [
    ({"canonical_shards": 6}, "canonical_shards"),
    ({"canonical_shards": 0}, "canonical_shards"),
    ({"canonical_shards": -4}, "canonical_shards"),
    ({"canonical_shards": 8.0}, "canonical_shards"),
    ({"backend": "cuda"}, "backend"),
    ({"accumulate_dtype": "bfloat16"}, "accumulate_dtype"),
    ({"accumulate_dtype": "float16"}, "accumulate_dtype"),
    ({"logits_dtype": "bfloat16"}, "logits_dtype"),
    ({"reduction": "ring"}, "reduction"),
    ({"contract_version": 2}, "contract_version"),
    ({"attention_block_size": 0}, "attention_block_size"),
    ({"gemm_row_multiple": -16}, "gemm_row_multiple"),
    ({"vocab_pad_multiple": "128"}, "vocab_pad_multiple"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"canonical_shard": 8}, "canonical_shard"),
]


@pytest.mark.parametrize("data,field", BAD_FIELDS, ids=[f for _, f in BAD_FIELDS])
def test_validation_error_names_the_field_yaml(tmp_path, data, field):
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as exc:
        load_profile(path)
    assert field in str(exc.value)
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize("data,field", BAD_FIELDS, ids=[f for _, f in BAD_FIELDS])
def test_validation_error_names_the_field_dict(data, field):
    with pytest.raises(ConfigError) as exc:
        profile_from_dict(data)
    assert field in str(exc.value)


def test_validation_in_constructor_and_replace():
    with pytest.raises(ConfigError, match="canonical_shards"):
        Profile(canonical_shards=12)
    with pytest.raises(ConfigError, match="backend"):
        dataclasses.replace(Profile(), backend="cuda")
    for ok in ("auto", "torch", "npu", "triton"):
        assert Profile(backend=ok).backend == ok
    for c in (1, 2, 4, 16):
        assert Profile(canonical_shards=c).canonical_shards == c


def test_non_mapping_yaml_rejected(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError) as exc:
        load_profile(str(path))
    assert "mapping" in str(exc.value)


def test_unknown_profile_name():
    with pytest.raises(ConfigError) as exc:
        load_profile("no-such-profile-xyz")
    msg = str(exc.value)
    assert "no-such-profile-xyz" in msg
    assert "profile" in msg
    assert "default" in msg  # lists the bundled profiles


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_check_tp_accepts_divisors(tp):
    Profile(canonical_shards=8).check_tp(tp)


@pytest.mark.parametrize("tp", [3, 16, 0, 6, 12])
def test_check_tp_rejects(tp):
    with pytest.raises(ConfigError) as exc:
        Profile(canonical_shards=8).check_tp(tp)
    assert "canonical_shards" in str(exc.value)
    assert str(tp) in str(exc.value)


def test_check_tp_names_the_setting():
    with pytest.raises(ConfigError) as exc:
        Profile(canonical_shards=4).check_tp(8, setting="expert_tensor_parallel_size")
    assert "expert_tensor_parallel_size" in str(exc.value)
    Profile(canonical_shards=4).check_tp(4)


def test_padded_vocab_size():
    p = Profile()
    assert p.padded_vocab_size(1000) == 1024
    assert p.padded_vocab_size(1024) == 1024
    assert p.padded_vocab_size(1025) == 2048
    assert p.padded_vocab_size(1) == 1024
    q = p.padded_vocab_size(151936)
    assert q % 1024 == 0 and q >= 151936 and q - 151936 < 1024
    # C and the pad multiple both enter; the result is a multiple of both
    small = Profile(canonical_shards=2, vocab_pad_multiple=64)
    assert small.padded_vocab_size(1000) == 1024
    assert small.padded_vocab_size(129) == 256
    assert small.padded_vocab_size(1000) % small.canonical_shards == 0


def test_digest_stable():
    a, b = load_profile(), load_profile()
    assert a.digest() == b.digest() == Profile().digest()
    assert len(a.digest()) == 16
    int(a.digest(), 16)  # hex


@pytest.mark.parametrize(
    "change",
    [
        {"canonical_shards": 4},
        {"attention_block_size": 64},
        {"gemm_row_multiple": 32},
        {"vocab_pad_multiple": 64},
        {"backend": "torch"},
        {"name": "other"},
    ],
)
def test_digest_changes_with_any_field(change):
    base = Profile()
    changed = dataclasses.replace(base, **change)
    assert changed.digest() != base.digest()
    assert dataclasses.replace(changed, **{k: getattr(base, k) for k in change}).digest() == base.digest()


def test_digest_of_yaml_matches_equivalent_dict(tmp_path):
    path = _write(tmp_path, {"canonical_shards": 4, "backend": "torch"})
    assert load_profile(path).digest() == Profile(canonical_shards=4, backend="torch").digest()


@pytest.mark.parametrize("field", ["canonical_shards", "gemm_row_multiple", "attention_block_size"])
def test_booleans_are_not_integers(field):
    with pytest.raises(ConfigError, match=field):
        Profile(**{field: True})
