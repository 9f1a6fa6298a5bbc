import numpy as np
import pytest

from fedlang.simulation.formats import directory


def test_npy_files_per_client(tmp_path):
    for cid, n in (("b", 2), ("a", 1)):
        (tmp_path / cid).mkdir()
        for i in range(n):
            np.save(tmp_path / cid / f"{i}.npy", np.full(3, i, np.float32))
    (tmp_path / "empty").mkdir()
    cd = directory.from_directory(tmp_path)
    assert cd.client_ids == ["a", "b", "empty"]
    assert [e.tolist() for e in cd.create_dataset_for_client("b")] == [[0, 0, 0], [1, 1, 1]]
    assert str(cd.element_spec) == "float32[3]"
    assert list(cd.create_dataset_for_client("empty")) == []


def test_custom_decoder_is_lazy(tmp_path):
    (tmp_path / "c1").mkdir()
    (tmp_path / "c1" / "x.txt").write_text("hello")
    decoded = []

    def decode(p):
        decoded.append(p.name)
        return {"text": p.read_text()}

    cd = directory.from_directory(tmp_path, decode_fn=decode)
    ds = cd.create_dataset_for_client("c1")
    assert decoded == []
    assert list(ds) == [{"text": "hello"}]


def test_missing_root(tmp_path):
    with pytest.raises(FileNotFoundError, match="client folders"):
        directory.from_directory(tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="sub-directory"):
        directory.from_directory(tmp_path)
