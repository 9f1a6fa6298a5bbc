"""`fedlang data inspect` and `fedlang data convert` (src/fedlang/cli/data.py)."""

import numpy as np
import pytest

import fedlang.simulation as sim

from ._run import fedlang, invoke, one_sentence_error


@pytest.fixture
def store_path(tmp_path):
    cd = sim.datasets.digits(num_clients=6, partition="iid", seed=0)
    return sim.store.write(tmp_path / "digits_store", cd)


def test_data_inspect_store(store_path):
    result = invoke("data", "inspect", store_path)
    assert result.exit_code == 0, result.output
    assert "6" in result.output and "1,797" in result.output
    assert "<x=float32[64],y=int32>" in result.output
    assert "Clients by number of examples" in result.output


def test_data_convert_csv_then_inspect(tmp_path):
    csv_path = tmp_path / "d.csv"
    csv_path.write_text("user,a,label\nu1,0.5,1\nu1,1.5,0\nu2,2.5,1\n")
    missing = invoke("data", "convert", csv_path, tmp_path / "s")
    assert missing.exit_code == 1 and "['user', 'a', 'label']" in missing.output
    result = invoke("data", "convert", csv_path, tmp_path / "s", "--client-column", "user")
    assert result.exit_code == 0, result.output
    assert "Wrote 2 clients, 3 examples" in result.output
    assert sim.ClientData.from_store(tmp_path / "s").num_examples("u1") == 2
    again = invoke("data", "convert", csv_path, tmp_path / "s", "--client-column", "user")
    assert again.exit_code == 1 and "overwrite" in again.output


def test_data_inspect_sqlite_lists_splits_then_decodes(tmp_path):
    from fedlang.simulation.formats import sqlite

    path = tmp_path / "t.sqlite"
    sqlite.write_sqlite(path, "train", {"a": [{"pixels": np.ones(4, np.float32), "label": np.int64([3])}]})
    listed = invoke("data", "inspect", path)
    assert listed.exit_code == 0 and "['train']" in listed.output
    detail = invoke("data", "inspect", path, "--split", "train")
    assert detail.exit_code == 0, detail.output
    assert "label=int32" in detail.output and "pixels=float32[4]" in detail.output


@pytest.mark.parametrize("content, message", [
    (None, "found nothing there"),
    (b"not a store", "Expected a store directory"),
])
def test_data_inspect_bad_paths(tmp_path, content, message):
    path = tmp_path / "thing.bin"
    if content is not None:
        path.write_bytes(content)
    result = invoke("data", "inspect", path)
    assert result.exit_code == 1 and message in result.output


def test_data_inspect_corrupt_store(store_path):
    (store_path / "index.json").write_text("{")
    result = invoke("data", "inspect", store_path)
    assert result.exit_code == 1 and "corrupt" in result.output


def test_data_convert_advice_names_the_overwrite_flag(tmp_path):
    (tmp_path / "d.csv").write_text("user,a,label\nu1,0.5,1\n")
    (tmp_path / "s").mkdir()
    result = fedlang("data", "convert", "d.csv", "s", "--client-column", "user", cwd=tmp_path)
    one_sentence_error(result, 1, "Pass --overwrite")
    assert "overwrite=True" not in result[2]


def test_a_wrong_file_for_a_csv_dataset_is_named_never_printed(tmp_path):
    # issue 37: an .npz given as a CSV file printed pyarrow's message with the file's
    # bytes (NULs, control characters) on the terminal
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 2), np.float32), y=np.arange(4))
    (tmp_path / "bell.csv").write_bytes(b"user,a\nu1,1\nu2,\x07beep,\x1b[31mred\n")
    npz, bell = results = [fedlang("data", "inspect", name, "--format", "csv", "--client-column",
                                   "user", cwd=tmp_path) for name in ("data.npz", "bell.csv")]
    one_sentence_error(npz, 1, "Expected a CSV file at data.npz, found a zip archive (an .npz?).")
    # a real parse error still says what pyarrow found, its control characters escaped
    one_sentence_error(bell, 1, "at bell.csv, found unparsable data", "Expected 2 columns, got 3",
                       r"u2,\x07beep,\x1b[31mred")
    for _, _, err in results:
        assert not any(c < " " for c in err.replace("\n", "")), repr(err)
