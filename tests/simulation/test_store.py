import collections
import threading

import numpy as np
import pyarrow as pa
import pytest

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import store

ClientData = client_data_lib.ClientData


def _source():
    return ClientData.from_tensor_slices({
        "a": {"img": np.arange(24, dtype=np.float32).reshape(3, 2, 4), "label": np.arange(3, dtype=np.int32),
              "text": ["x", "yy", "zzz"]},
        "b": {"img": np.ones((2, 2, 4), np.float32), "label": np.array([7, 8], np.int32), "text": ["p", "q"]},
    })


def test_round_trip_values_and_spec(tmp_path):
    path = store.write(tmp_path / "s", _source())
    cd = ClientData.from_store(path)
    assert cd.client_ids == ["a", "b"]
    assert cd.num_examples("a") == 3
    arrays = store.open_store(path).read_arrays("a")
    np.testing.assert_array_equal(arrays["img"], np.arange(24, dtype=np.float32).reshape(3, 2, 4))
    assert arrays["label"].dtype == np.int32 and arrays["text"].tolist() == ["x", "yy", "zzz"]
    batch = next(iter(cd.create_dataset_for_client("b").batch(5)))
    assert batch["label"].tolist() == [7, 8] and batch["img"].shape == (2, 2, 4)
    no_text = cd.preprocess(lambda ds: ds.map(lambda e: {"img": e["img"], "label": e["label"]}))
    assert str(no_text.element_spec) == "<img=float32[2,4],label=int32>"


def test_read_client_and_empty_client(tmp_path):
    path = store.write(tmp_path / "s", [("e", []), ("f", [{"v": np.float32(1)}, {"v": np.float32(2)}])])
    assert list(store.read_client(path, "e")) == []
    assert [float(e["v"]) for e in store.read_client(path, "f")] == [1.0, 2.0]
    with pytest.raises(KeyError, match="'g'"):
        store.read_client(path, "g")


def test_client_spanning_record_batches(tmp_path):
    rows = [{"v": np.full(4, i, np.int64)} for i in range(100)]
    path = store.write(tmp_path / "s", {"c0": rows[:3], "c1": rows[3:]}, max_batch_bytes=256)
    s = store.open_store(path)
    assert s.read_arrays("c1")["v"][:, 0].tolist() == list(range(3, 100))


def test_namedtuple_and_bytes_structure(tmp_path):
    pair = collections.namedtuple("Pair", ["k", "v"])
    path = store.write(tmp_path / "s", [("a", [pair(b"k1", np.bool_(True))])])
    element = next(iter(store.read_client(path, "a")))
    assert element.k == b"k1" and bool(element.v) and type(element).__name__ == "Pair"


def test_write_errors(tmp_path):
    path = store.write(tmp_path / "s", _source())
    with pytest.raises(FileExistsError, match="overwrite=True"):
        store.write(path, _source())
    store.write(path, {"z": [{"v": np.int32(1)}]}, overwrite=True)
    assert ClientData.from_store(path).client_ids == ["z"]
    with pytest.raises(ValueError, match="twice"):
        store.write(tmp_path / "d", [("a", [{"v": 1}]), ("a", [{"v": 2}])])
    with pytest.raises(ValueError, match="shape"):
        store.write(tmp_path / "r", {"a": [{"v": np.zeros(2)}, {"v": np.zeros(3)}]})
    with pytest.raises(ValueError, match="element_spec"):
        store.write(tmp_path / "n", {"a": []})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="non-empty"):
        store.write(tmp_path / "other", _source(), overwrite=True)


def test_interrupted_write_leaves_nothing(tmp_path):
    def rows():
        yield {"v": np.int32(1)}
        raise RuntimeError("source failed")

    with pytest.raises(RuntimeError):
        store.write(tmp_path / "s", [("a", rows())])
    assert list(tmp_path.iterdir()) == []


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"store\.write"):
        store.open_store(tmp_path / "nope")
    path = store.write(tmp_path / "s", _source())
    (path / "data.arrow").write_bytes(b"garbage")
    with pytest.raises(store.StoreError, match=r"data\.arrow"):
        store.open_store(path)
    path = store.write(tmp_path / "s", _source(), overwrite=True)
    (path / "index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"index\.json.*Re-create"):
        store.open_store(path)
    (path / "index.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"index\.json"):
        store.open_store(path)


def test_iterating_large_store_does_not_load_it(tmp_path):
    # ~120 MB written in 32 KB rows; reading maps pages in, allocating nothing.
    row = np.ones(8192, np.float32)

    def clients():
        for c in range(60):
            yield f"c{c}", ({"x": row, "y": np.int32(i)} for i in range(64))

    path = store.write(tmp_path / "big", clients(), max_batch_bytes=8 << 20)
    assert (path / "data.arrow").stat().st_size > 100e6
    cd = ClientData.from_store(path)
    before = pa.total_allocated_bytes()
    peak = 0
    total = 0.0
    for ds in cd.datasets():
        for batch in ds.batch(32):
            total += float(batch["x"][:, 0].sum())
            peak = max(peak, pa.total_allocated_bytes() - before)
    assert total == 60 * 64
    assert peak < 1 << 20


def test_concurrent_reads(tmp_path):
    path = store.write(tmp_path / "s", _source())
    cd = ClientData.from_store(path)
    errors = []

    def read():
        try:
            for _ in range(20):
                for ds in cd.datasets():
                    list(ds)
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
