import json

import pytest

from fedlang.simulation.formats import leaf


def _write(tmp_path):
    d = tmp_path / "train"
    d.mkdir()
    (d / "a.json").write_text(json.dumps({
        "users": ["u1", "u2"], "num_samples": [2, 1],
        "user_data": {"u1": {"x": [[0.5, 1.0], [2.0, 3.0]], "y": [1, 0]}, "u2": {"x": [[9.0, 9.0]], "y": [4]}}}))
    (d / "b.json").write_text(json.dumps({
        "users": ["u3"], "num_samples": [1], "user_data": {"u3": {"x": ["to be or"], "y": ["n"]}}}))
    return d


def test_reads_users_across_files(tmp_path):
    cd = leaf.from_leaf(_write(tmp_path))
    assert cd.client_ids == ["u1", "u2", "u3"] and cd.num_examples("u1") == 2
    rows = list(cd.create_dataset_for_client("u1"))
    assert rows[1]["x"].tolist() == [2.0, 3.0] and int(rows[1]["y"]) == 0
    assert str(cd.element_spec) == "<x=float32[2],y=int32>"
    assert [r["x"] for r in cd.create_dataset_for_client("u3")] == ["to be or"]


def test_bad_leaf_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="LEAF"):
        leaf.from_leaf(tmp_path)
    (tmp_path / "x.json").write_text('{"users": []}')
    with pytest.raises(ValueError, match=r"missing \['num_samples', 'user_data'\]"):
        leaf.from_leaf(tmp_path)
    (tmp_path / "x.json").write_text("{broken")
    with pytest.raises(ValueError, match="invalid JSON"):
        leaf.from_leaf(tmp_path / "x.json")


def test_duplicate_user_rejected(tmp_path):
    d = _write(tmp_path)
    (d / "c.json").write_text(json.dumps({"users": ["u1"], "num_samples": [0], "user_data": {"u1": {"x": [], "y": []}}}))
    with pytest.raises(ValueError, match="'u1'"):
        leaf.from_leaf(d)
