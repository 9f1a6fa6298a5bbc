"""The `.npz` check of a client's data (src/fedlang/deploy/client/data.py): numeric
arrays only, said with the file, the array and its dtype."""

import numpy as np
import pytest

from fedlang import deploy
from fedlang.deploy.client import data as data_lib


@pytest.mark.parametrize(("array", "said"), [
    (np.array(["cat", "dog"]), "array 'label' of dtype <U3 (text)"),
    (np.array([b"cat", b"dog"]), "array 'label' of dtype |S3 (bytes)"),
    (np.array(["2024-01-01", "2024-01-02"], "datetime64[D]"), "of dtype datetime64[D] (dates)"),
])
def test_non_numeric_arrays_are_refused_naming_the_file_array_and_dtype(tmp_path, array, said):
    # arrange: numbers in x, something else in label
    path = tmp_path / "client.npz"
    np.savez(path, x=np.zeros((2, 3), np.float32), label=array)
    # act
    with pytest.raises(ValueError) as e:
        data_lib.NpzDataset(path)
    # assert
    message = str(e.value)
    assert message.startswith(f"Expected {path} to hold numeric arrays, found ")
    assert said in message and "numpy.savez" in message


def test_pickled_objects_are_refused_as_such(tmp_path):
    path = tmp_path / "client.npz"
    np.savez(path, x=np.zeros(2, np.float32), y=np.array([{"a": 1}, None], dtype=object))
    with pytest.raises(ValueError, match=r"array 'y' of dtype object \(Python objects, pickled\)"):
        data_lib.NpzDataset(path)


def test_a_client_refuses_text_arrays_before_it_enrolls(tmp_path):
    path = tmp_path / "client.npz"
    np.savez(path, x=np.zeros((2, 3), np.float32), y=np.array(["a", "b"]))
    with pytest.raises(ValueError, match=r"found array 'y' of dtype <U1 \(text\)"):
        deploy.Client("http://127.0.0.1:9", "pop", "t", {"train": str(path)})


def test_bool_integer_float_and_complex_arrays_are_read(tmp_path):
    path = tmp_path / "client.npz"
    arrays = {"m": np.array([True, False]), "i": np.arange(2, dtype=np.int64),
              "u": np.arange(2, dtype=np.uint8), "f": np.zeros(2, np.float16),
              "c": np.zeros(2, np.complex64)}
    np.savez(path, **arrays)
    (batch,) = list(data_lib.NpzDataset(path, batch_size=2))
    assert {k: v.dtype for k, v in batch.items()} == {k: v.dtype for k, v in arrays.items()}
