import numpy as np
import pandas as pd
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
