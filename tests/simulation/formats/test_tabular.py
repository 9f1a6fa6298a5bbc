import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from fedlang.simulation.formats import tabular

CSV = "speaker,text,score\nbob,hello there,1.5\nann,hi,2.0\nbob,bye,3.0\n"


def test_from_csv_groups_by_client(tmp_path):
    path = tmp_path / "lines.csv"
    path.write_text(CSV)
    cd = tabular.from_csv(path, client_id_column="speaker")
    assert cd.client_ids == ["ann", "bob"] and cd.num_examples("bob") == 2
    rows = list(cd.create_dataset_for_client("bob"))
    assert [r["text"] for r in rows] == ["hello there", "bye"]
    assert rows[0]["score"].dtype == np.float32
    numeric = cd.preprocess(lambda ds: ds.map(lambda e: {"score": e["score"]}))
    assert str(numeric.element_spec) == "<score=float32>"


def test_from_csv_missing_column_lists_columns(tmp_path):
    path = tmp_path / "lines.csv"
    path.write_text(CSV)
    with pytest.raises(ValueError, match=r"'user'.*\['speaker', 'text', 'score'\]"):
        tabular.from_csv(path, client_id_column="user")
    with pytest.raises(FileNotFoundError):
        tabular.from_csv(tmp_path / "none.csv", client_id_column="speaker")


def test_from_pandas_with_columns_and_dtypes():
    df = pd.DataFrame({"uid": [3, 1, 3], "x": [1, 2, 3], "y": [0.5, 1.5, 2.5]})
    cd = tabular.from_pandas(df, "uid", columns=["y"], dtypes={"y": np.float64})
    assert cd.client_ids == ["1", "3"]
    assert [float(e["y"]) for e in cd.create_dataset_for_client("3")] == [0.5, 2.5]
    assert str(cd.element_spec) == "<y=float64>"
    with pytest.raises(ValueError, match="columns"):
        tabular.from_pandas(df, "speaker")
    with pytest.raises(TypeError, match="DataFrame"):
        tabular.from_pandas({"uid": [1]}, "uid")


def _csv(tmp_path, text):
    path = tmp_path / "t.csv"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def test_csv_value_too_large_for_int32_is_refused_with_its_line(tmp_path):
    # Before: 3000000000 became -1294967296.
    path = _csv(tmp_path, "uid,y\na,1\nb,3000000000\n")
    with pytest.raises(ValueError, match=r"column 'y'.*3000000000 at line 3 of .*t\.csv.*dtypes=\{'y': np\.int64\}"):
        tabular.from_csv(path, "uid")
    cd = tabular.from_csv(path, "uid", dtypes={"y": np.int64})
    assert [int(e["y"]) for e in cd.create_dataset_for_client("b")] == [3_000_000_000]


def test_csv_values_that_a_requested_dtype_would_change_are_refused(tmp_path):
    path = _csv(tmp_path, "uid,x,y,z\na,1.5,300,1e300\n")
    with pytest.raises(ValueError, match=r"column 'x'.*1\.5 at line 2.*not an integer"):
        tabular.from_csv(path, "uid", columns=["x"], dtypes={"x": np.int32})
    with pytest.raises(ValueError, match=r"column 'y'.*300 at line 2.*range of int8"):
        tabular.from_csv(path, "uid", columns=["y"], dtypes={"y": np.int8})
    with pytest.raises(ValueError, match=r"column 'z'.*1e\+300 at line 2.*overflows float32"):
        tabular.from_csv(path, "uid", columns=["z"])
    with pytest.raises(ValueError, match=r"numbers in column 'uid'.*found text"):
        tabular.from_arrow_table(pa.table({"k": ["a"], "uid": ["x"]}), "k", dtypes={"uid": np.int32})


def test_csv_blank_cells_are_refused_with_their_line(tmp_path):
    # Before: a blank int cell became NaN and the column float32 (or -2147483648 with dtypes).
    path = _csv(tmp_path, "uid,y,x\na,1,0.5\nb,,\n")
    for dtypes in (None, {"y": np.int32}):
        with pytest.raises(ValueError, match=r"every row of column 'y'.*blank at line 3 of .*t\.csv.*missing='nan'"):
            tabular.from_csv(path, "uid", dtypes=dtypes)
    with pytest.raises(ValueError, match=r"column 'x'.*blank at line 3"):
        tabular.from_csv(path, "uid", columns=["x"])


def test_csv_blanks_as_nan_when_asked(tmp_path):
    path = _csv(tmp_path, "uid,y,x,empty\na,1,0.5,\nb,,,\n")
    cd = tabular.from_csv(path, "uid", missing="nan")
    assert str(cd.element_spec) == "<y=float32,x=float32,empty=float32>"
    row = next(iter(cd.create_dataset_for_client("b")))
    assert all(np.isnan(row[k]) for k in ("y", "x", "empty"))
    with pytest.raises(ValueError, match=r"column 'y'.*blank at line 3.*int32 has no NaN"):
        tabular.from_csv(path, "uid", dtypes={"y": np.int32}, missing="nan")
    with pytest.raises(ValueError, match=r"missing='error' or missing='nan'"):
        tabular.from_csv(path, "uid", missing="zero")


def test_csv_blank_client_id_is_refused(tmp_path):
    path = _csv(tmp_path, "uid,y\na,1\n,2\n")
    with pytest.raises(ValueError, match=r"client id in every row of column 'uid'.*blank at line 3"):
        tabular.from_csv(path, "uid")


def test_csv_text_that_is_not_utf8(tmp_path):
    # Before: one such cell turned the whole text column into bytes.
    path = _csv(tmp_path, b"uid,text\na,hello\nb,caf\xe9\n")
    with pytest.raises(ValueError, match=r"UTF-8 text in column 'text'.*line 3 of .*encoding='latin-1'"):
        tabular.from_csv(path, "uid")
    latin = tabular.from_csv(path, "uid", encoding="latin-1")
    assert [e["text"] for e in latin.create_dataset_for_client("b")] == ["café"]
    raw = tabular.from_csv(path, "uid", dtypes={"text": bytes})
    assert [e["text"] for e in raw.create_dataset_for_client("b")] == [b"caf\xe9"]


def test_csv_duplicate_header(tmp_path):
    # Before: KeyError: 'Field "x" exists 2 times in schema'.
    path = _csv(tmp_path, "uid,x,x\na,1,2\n")
    with pytest.raises(ValueError, match=r"distinct column names in .*t\.csv, found \['x'\] more than once"):
        tabular.from_csv(path, "uid")


def test_pandas_missing_values_and_overflow():
    df = pd.DataFrame({"uid": ["a", "b"], "y": [1.0, None], "big": [1, 2**40]})
    with pytest.raises(ValueError, match=r"column 'y'.*blank at row 1 of the DataFrame"):
        tabular.from_pandas(df, "uid", columns=["y"])
    with pytest.raises(ValueError, match=r"column 'big'.*1099511627776 at row 1 of the DataFrame"):
        tabular.from_pandas(df, "uid", columns=["big"])
    cd = tabular.from_pandas(df, "uid", columns=["y", "big"], dtypes={"big": np.int64}, missing="nan")
    assert np.isnan(next(iter(cd.create_dataset_for_client("b")))["y"])
