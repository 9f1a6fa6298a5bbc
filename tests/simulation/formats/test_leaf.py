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


def _leaf_file(tmp_path, content):
    path = tmp_path / "f.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize("content, message", [
    # Before: the user without a count was dropped silently.
    ({"users": ["u1", "u2"], "num_samples": [1], "user_data": {"u1": {"x": [1], "y": [0]}, "u2": {"x": [2], "y": [1]}}},
     r"as many num_samples as users \(2\), found 1"),
    # Before: accepted, and num_examples() said 5.
    ({"users": ["u1"], "num_samples": [5], "user_data": {"u1": {"x": [1, 2], "y": [0, 1]}}},
     r"5 examples of user 'u1' \(num_samples\), found 2"),
    # Before: IndexError when iterated.
    ({"users": ["u1"], "num_samples": [2], "user_data": {"u1": {"x": [1, 2], "y": [0]}}},
     r"as many y as x for user 'u1', found 2 x and 1 y"),
    # Before: KeyError: 'x' when iterated.
    ({"users": ["u1"], "num_samples": [1], "user_data": {"u1": {"y": [0]}}}, r"lists 'x' and 'y' for user 'u1'"),
    ({"users": ["u1"], "num_samples": [1], "user_data": {}}, r"user_data for user 'u1'"),
    ({"users": ["u1"], "num_samples": [None], "user_data": {"u1": {"x": [1], "y": [0]}}},
     r"non-negative integer num_samples for user 'u1', found None"),
    ({"users": "u1", "num_samples": [1], "user_data": {}}, r"'users' and 'num_samples' as lists"),
    # Before: RecursionError.
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_inconsistent_leaf_files_are_refused_when_opened(tmp_path, content, message):
    path = _leaf_file(tmp_path, content)
    with pytest.raises(ValueError, match=rf"{message}.*f\.json|f\.json.*{message}"):
        leaf.from_leaf(path)


def test_leaf_values_that_do_not_fit_are_refused_when_read(tmp_path):
    path = _leaf_file(tmp_path, {"users": ["u1", "u2", "u3"], "num_samples": [2, 1, 1], "user_data": {
        "u1": {"x": [1.0, 2.0], "y": [0, 3_000_000_000]},
        "u2": {"x": [[1.0, 2.0]], "y": [0]},
        "u3": {"x": [{"a": 1}], "y": [0]}}})
    cd = leaf.from_leaf(path)
    with pytest.raises(ValueError, match=r"'y' of user 'u1' in .*f\.json.*3000000000 at row 1.*int32"):
        list(cd.create_dataset_for_client("u1"))
    with pytest.raises(ValueError, match=r"numbers or strings in 'x' of user 'u3'.*f\.json"):
        list(cd.create_dataset_for_client("u3"))
    assert next(iter(cd.create_dataset_for_client("u2")))["x"].tolist() == [1.0, 2.0]
