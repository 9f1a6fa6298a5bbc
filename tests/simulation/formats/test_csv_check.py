"""What `from_csv` says of a file that is not CSV (src/fedlang/simulation/formats/tabular.py:
`check_csv_file`, `column_names`): what the file is, from its first bytes, never the bytes."""

import gzip
import sqlite3

import numpy as np
import pytest

from fedlang.simulation.formats import tabular


def _npz(path):
    with open(path, "wb") as f:  # a path would get the suffix .npz added
        np.savez(f, x=np.zeros(3, np.float32))


def _npy(path):
    with open(path, "wb") as f:
        np.save(f, np.zeros(3, np.float32))


def _sqlite(path):
    sqlite3.connect(path).execute("create table t (a)").connection.commit()


def _gzip(path):
    path.write_bytes(gzip.compress(b"user,a\nu1,1\n"))


def _binary(path):
    path.write_bytes(bytes(range(256)) * 4)


@pytest.mark.parametrize(("write", "found"), [
    (_npz, "found a zip archive (an .npz?). Pass a CSV file: text with a header row."),
    (_npy, "found a NumPy .npy array."),
    (_sqlite, "found an SQLite database."),
    (_gzip, "found gzip-compressed data. Decompress it first."),
    (_binary, "found binary data. Pass a CSV file"),
])
def test_another_format_is_named(tmp_path, write, found):
    path = tmp_path / "data.csv"
    write(path)
    for read in (lambda: tabular.from_csv(path, "user"), lambda: tabular.column_names(path)):
        with pytest.raises(ValueError) as e:
            read()
        assert str(e.value).startswith(f"Expected a CSV file at {path}, {found}")
        assert str(e.value).isprintable()


def test_utf16_text_asks_for_its_encoding_and_reads_with_it(tmp_path):
    path = tmp_path / "wide.csv"
    path.write_text("user,a\nu1,1\nu2,2\n", encoding="utf-16")
    with pytest.raises(ValueError, match=r"found UTF-16 text\. Pass encoding='utf-16'\."):
        tabular.from_csv(path, "user")
    assert tabular.from_csv(path, "user", encoding="utf-16").client_ids == ["u1", "u2"]


def test_a_control_byte_delimiter_and_a_stray_control_character_are_text(tmp_path):
    # Hive's exports separate fields with \x01
    hive = tmp_path / "hive.csv"
    hive.write_bytes(b"user\x01a\nu1\x011\nu2\x012\n")
    assert tabular.column_names(hive, delimiter="\x01") == ["user", "a"]
    assert tabular.from_csv(hive, "user", delimiter="\x01").client_ids == ["u1", "u2"]
    # one bell in a cell: the parse error quotes the row with it escaped
    bell = tmp_path / "bell.csv"
    bell.write_bytes(b"user,a\n" + b"u1,1\n" * 20 + b"u2,\x07beep,3\n")
    with pytest.raises(ValueError) as e:
        tabular.from_csv(bell, "user")
    assert str(e.value).isprintable()
    assert str(e.value).endswith(r"found unparsable data: CSV parse error: Expected 2 columns, got 3: u2,\x07beep,3")
