import collections
import dataclasses
import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlang.simulation import checkpoint

Opt = collections.namedtuple("Opt", ["count", "mu"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class State:
    model: dict
    opt: Opt
    key: jax.Array
    round: int


def _state(scale=1.0):
    return State(
        model={"kernel": jnp.full((3, 2), scale, jnp.float32), "bias": np.zeros(2, np.float32)},
        opt=Opt(np.int32(4), (jnp.ones(2, jnp.bfloat16), np.arange(3, dtype=np.int64))),
        key=jax.random.key(5),
        round=7,
    )


def test_round_trip_keeps_structure_types_and_bits(tmp_path):
    state = _state(0.1)
    fp = checkpoint.fingerprint({"lr": 0.1}, state)
    checkpoint.save(tmp_path, 3, state, fingerprint=fp, config={"lr": 0.1}, driver_state={"s": 1})
    ckpt = checkpoint.load(checkpoint.latest(tmp_path))
    restored = ckpt.restore(_state(), fp)
    assert ckpt.round_num == 3 and ckpt.driver_state == {"s": 1}
    assert isinstance(restored, State) and isinstance(restored.opt, Opt) and restored.round == 7
    assert isinstance(restored.model["kernel"], jax.Array)
    assert isinstance(restored.model["bias"], np.ndarray)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.array_equal(np.asarray(a), np.asarray(b)) and np.asarray(a).dtype == np.asarray(b).dtype
    assert np.array_equal(jax.random.normal(restored.key, (2,)), jax.random.normal(state.key, (2,)))


def test_leaves_match_by_path_so_dict_and_namedtuple_interchange(tmp_path):
    Model = collections.namedtuple("Model", ["w", "b"])
    saved = Model(np.ones(2, np.float32), np.zeros(1, np.float32))
    live = {"b": np.full(1, 9, np.float32), "w": np.full(2, 9, np.float32)}
    assert checkpoint.fingerprint(None, saved) == checkpoint.fingerprint(None, live)
    checkpoint.save(tmp_path, 1, saved, fingerprint="x")
    restored = checkpoint.load(checkpoint.latest(tmp_path)).restore(live)
    assert restored["w"].tolist() == [1.0, 1.0] and restored["b"].tolist() == [0.0]


def test_structure_mismatch_is_refused_with_the_difference(tmp_path):
    state = _state()
    checkpoint.save(tmp_path, 1, state, fingerprint=checkpoint.fingerprint({}, state))
    other = dataclasses.replace(state, model={"kernel": jnp.zeros((4, 2), jnp.float32),
                                              "bias": np.zeros(2, np.float32)})
    ckpt = checkpoint.load(checkpoint.latest(tmp_path))
    with pytest.raises(checkpoint.CheckpointMismatchError,
                       match=r"'model/kernel': checkpoint float32\[3, 2\], this run float32\[4, 2\]"):
        ckpt.restore(other, checkpoint.fingerprint({}, other), {})
    with pytest.raises(checkpoint.CheckpointMismatchError, match="live state's structure"):
        ckpt.restore(other)


def test_keeps_the_newest_and_ignores_temporary_files(tmp_path):
    for r in (1, 2, 3):
        checkpoint.save(tmp_path, r, {"w": np.float32(r)}, fingerprint="f", keep=2)
    (tmp_path / ".ckpt-00000009.fedlckpt.tmp-dead").write_bytes(b"partial")
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == [
        "ckpt-00000002.fedlckpt", "ckpt-00000003.fedlckpt"]
    assert checkpoint.latest(tmp_path / "missing") is None
    with pytest.raises(ValueError, match="keep >= 1"):
        checkpoint.save(tmp_path, 4, {}, fingerprint="f", keep=0)


def test_exception_mid_write_leaves_previous_checkpoint_and_no_partial_file(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, {"w": np.float32(1)}, fingerprint="f")
    seen = []

    def die_after_writing(fd):  # the new file's bytes are written, not yet renamed
        seen.extend(p.name for p in tmp_path.iterdir())
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "fsync", die_after_writing)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, 2, {"w": np.float32(2)}, fingerprint="f")
    monkeypatch.undo()
    assert any(name.startswith(".ckpt-00000002") for name in seen)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000001.fedlckpt"]
    assert checkpoint.load(checkpoint.latest(tmp_path)).leaves[0] == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "empty"])
def test_corrupt_files_raise_checkpoint_error_naming_the_fix(tmp_path, damage):
    path = checkpoint.save(tmp_path, 1, {"w": np.arange(100, dtype=np.float32)}, fingerprint="f")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-40] ^= 0xFF
    elif damage == "magic":
        data[:4] = b"PK\x03\x04"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=r"Delete .*ckpt-00000001.fedlckpt to resume"):
        checkpoint.load(path)


def test_missing_file_and_unjsonable_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="Expected a checkpoint file"):
        checkpoint.load(tmp_path / "nope.fedlckpt")
    with pytest.raises(TypeError, match="JSON-serializable run config"):
        checkpoint.fingerprint({"opt": object()}, {})


def test_docstring_example():
    result = doctest.testmod(checkpoint)
    assert result.attempted > 0 and result.failed == 0
