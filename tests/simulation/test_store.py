import collections
import json
import pathlib
import shutil
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


# -- damaged and untrusted files ---------------------------------------------------

V1_STORE = pathlib.Path(__file__).resolve().parent / "data" / "store_v1"


def _edit_index(path, edit):
    index = json.loads((path / "index.json").read_text())
    edit(index)
    (path / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("edit, message", [
    (lambda ix: ix["clients"].update(b=[2, 2, ix["clients"]["b"][2]]), "overlap at row 2"),
    (lambda ix: ix["clients"].update(b=[3, 3, ix["clients"]["b"][2]]), "cover 5 rows, found 6"),
    (lambda ix: ix["clients"].update(b=[3, 1, ix["clients"]["b"][2]]), "cover 5 rows, found 4"),
    (lambda ix: ix["clients"].update(b=[3, -2, 0]), "non-negative integers for client 'b'"),
    (lambda ix: ix["clients"].update(b=[3, 2.0, 0]), "non-negative integers for client 'b'"),
    (lambda ix: ix["clients"].update(b=[3, 2]), r"\[row offset, row count, crc32\]"),
    (lambda ix: ix["clients"].update(b=[3, 2**64, 0]), "non-negative integers for client 'b'"),
    (lambda ix: ix["clients"].update(b=[3, 2, 2**32]), "non-negative integers for client 'b'"),
    (lambda ix: ix["clients"].update(b=[3, True, 0]), "non-negative integers for client 'b'"),
    (lambda ix: ix.update(clients=[]), "clients as an object"),
    (lambda ix: ix.update(num_rows=7), "batch_offsets increasing from 0 to num_rows"),
    (lambda ix: ix.update(version=3), "version 1 or 2"),
    (lambda ix: ix["structure"]["dict"][0][1].update(column="pixels"), "column 'img'"),
    (lambda ix: ix["structure"]["dict"][1][1].update(dtype="object"), "integer or float dtype"),
    (lambda ix: ix["structure"]["dict"][1][1].update(dtype="i4,i4"), "integer or float dtype"),
    (lambda ix: ix["structure"]["dict"][0][1].update(shape=[2**40]), "fewer than 2\\*\\*31 values"),
    (lambda ix: ix["structure"]["dict"][0][1].update(shape=[2, True]), "shape of non-negative integers"),
    (lambda ix: ix.update(structure={"namedtuple": "os; import sys", "fields": ["a"],
                                     "items": [{"column": "a", "dtype": "int32", "shape": []}]}), "Python identifier"),
])
def test_invalid_index_raises_store_error_naming_it(tmp_path, edit, message):
    path = store.write(tmp_path / "s", _source())
    _edit_index(path, edit)
    with pytest.raises(store.StoreError, match=rf"index\.json.*{message}"):
        store.open_store(path)


@pytest.mark.parametrize("edit, message", [
    (lambda ix: ix["structure"]["dict"][1][1].update(dtype="int64"), r"columns .*label: int32"),
    (lambda ix: ix["structure"]["dict"][0][1].update(shape=[4, 2]), "element structure"),
    (lambda ix: ix["structure"]["dict"].reverse(), r"columns \['text: large_string'"),
])
def test_index_that_disagrees_with_the_data_file(tmp_path, edit, message):
    # Before: a changed dtype or shape was read with the new meaning, silently.
    path = store.write(tmp_path / "s", _source())
    _edit_index(path, edit)
    with pytest.raises(store.StoreError, match=rf"data\.arrow to match .*index\.json.*{message}"):
        store.open_store(path)


def test_index_that_is_not_utf8_or_too_deep(tmp_path):
    path = store.write(tmp_path / "s", _source())
    (path / "index.json").write_bytes((path / "index.json").read_bytes().replace(b'"a"', b'"\xff"'))
    with pytest.raises(store.StoreError, match=r"index\.json: Expected UTF-8 text"):
        store.open_store(path)
    (path / "index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(store.StoreError, match=r"index\.json: Expected JSON of reasonable depth"):
        store.open_store(path)


def test_changed_value_fails_the_checksum_of_its_client_only(tmp_path):
    source = {"a": [{"v": np.full(4, 1.5, np.float32)}] * 3, "b": [{"v": np.full(4, 2.5, np.float32)}] * 2}
    path = store.write(tmp_path / "s", source)
    data = bytearray((path / "data.arrow").read_bytes())
    at = data.index(np.full(4, 2.5, np.float32).tobytes())
    data[at + 1] ^= 0x40  # one value of client b, still a valid float32
    (path / "data.arrow").write_bytes(bytes(data))
    s = store.open_store(path)
    assert s.read_arrays("a")["v"].tolist() == [[1.5] * 4] * 3
    with pytest.raises(store.StoreError, match=r"client 'b' in .*data\.arrow to match their checksum"):
        s.read_arrays("b")
    with pytest.raises(store.StoreError, match="client 'b'"):
        list(ClientData.from_store(path).create_dataset_for_client("b"))


def test_renamed_client_fails_its_checksum(tmp_path):
    path = store.write(tmp_path / "s", {"a": [{"v": np.int32(1)}], "e": []})
    _edit_index(path, lambda ix: ix["clients"].update(z=ix["clients"].pop("a"), y=ix["clients"].pop("e")))
    s = store.open_store(path)
    for cid in ("z", "y"):
        with pytest.raises(store.StoreError, match=f"client '{cid}'"):
            s.read_arrays(cid)


def test_version_1_store_reads_unverified_with_a_warning(tmp_path):
    shutil.copytree(V1_STORE, tmp_path / "v1")
    with pytest.warns(UserWarning, match=r"store version 1\) without checksums.*Re-create"):
        s = store.open_store(tmp_path / "v1")
    assert not s.verified and s.client_ids == ["a", "b", "c"]
    arrays = s.read_arrays("a")
    assert arrays["x"].tolist() == [[1.5, 2.5]] and arrays["t"].tolist() == ["hi"]
    assert s.read_arrays("b")["y"].shape == (0,)
    assert store.open_store(store.write(tmp_path / "v2", s.client_data())).verified


def test_store_rewritten_while_open(tmp_path):
    path = store.write(tmp_path / "s", _source())
    s = store.open_store(path)
    store.write(path, _source(), overwrite=True)
    with pytest.raises(store.StoreError, match=r"replaced.*Open it again"):
        s.read_arrays("a")
    assert store.open_store(path).read_arrays("a")["label"].tolist() == [0, 1, 2]


# -- what write accepts ------------------------------------------------------------


def test_write_refuses_sources_of_another_kind(tmp_path):
    # Before: np.zeros((10, 4)) gave "too many values to unpack".
    with pytest.raises(TypeError, match=r"found an array of shape \(10, 4\).*from_numpy\(x, y, partition\)"):
        store.write(tmp_path / "s", np.zeros((10, 4)))
    with pytest.raises(TypeError, match=r"not a \(client_id, elements\) pair"):
        store.write(tmp_path / "s", [("a", [1], "extra")])
    with pytest.raises(TypeError, match=r"iterable of elements for client 'a', found dict.*from_tensor_slices"):
        store.write(tmp_path / "s", {"a": {"x": np.zeros((3, 2))}})
    assert list(tmp_path.iterdir()) == []


def test_write_refuses_values_that_do_not_fit_the_declared_dtype(tmp_path):
    # Before: 3000000000 was stored as -1294967296.
    rows = [{"v": np.int64(5)}, {"v": np.int64(3_000_000_000)}]
    with pytest.raises(ValueError, match=r"fit dtype int32 in field 'v'.*3000000000 at row 1"):
        store.write(tmp_path / "s", {"a": rows}, element_spec={"v": np.int32})
    path = store.write(tmp_path / "s", {"a": rows[:1]}, element_spec={"v": np.int32})
    assert store.open_store(path).read_arrays("a")["v"].dtype == np.int32
