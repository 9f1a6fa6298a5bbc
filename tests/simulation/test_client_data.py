import numpy as np
import pytest

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib

ClientData = client_data_lib.ClientData


def _cd():
    return ClientData.from_tensor_slices({
        "a": {"x": np.arange(3, dtype=np.float32)},
        "b": {"x": np.arange(2, dtype=np.float32)},
        "c": {"x": np.arange(0, dtype=np.float32)},
    })


def test_ids_spec_and_counts():
    cd = _cd()
    assert cd.client_ids == ["a", "b", "c"]
    assert str(cd.element_spec) == "<x=float32>"
    assert [cd.num_examples(c) for c in cd.client_ids] == [3, 2, 0]


def test_empty_client_yields_nothing():
    assert list(_cd().create_dataset_for_client("c")) == []


def test_unknown_client_error_names_id_and_fix():
    with pytest.raises(KeyError, match=r"'zz'.*client_ids"):
        _cd().create_dataset_for_client("zz")
    with pytest.raises(ValueError, match="'zz'"):
        _cd().num_examples("zz")


def test_create_dataset_is_lazy():
    reads = []

    def fn(cid):
        return dataset_lib.Dataset.from_generator_fn(lambda: (reads.append(cid), iter([1, 2]))[1], np.int64)

    cd = ClientData.from_clients_and_fn(["p", "q"], fn)
    ds = cd.create_dataset_for_client("p")
    assert reads == []
    assert list(ds) == [1, 2] and reads == ["p"]
    assert cd.num_examples("q") == 2  # counted by iterating


def test_bad_ids_rejected():
    with pytest.raises(TypeError, match="string client ids"):
        ClientData([1, 2], lambda c: None)
    with pytest.raises(ValueError, match="duplicates"):
        ClientData(["a", "a"], lambda c: None)


def test_datasets_generator_limit_and_seed():
    cd = _cd()
    assert [ds.cardinality for ds in cd.datasets(limit_count=2)] == [3, 2]
    assert sorted(ds.cardinality for ds in cd.datasets(seed=1)) == [0, 2, 3]


def test_preprocess_applies_lazily_per_client():
    cd = _cd().preprocess(lambda ds: ds.map(lambda e: {"x": e["x"] + 1}).batch(2))
    batches = list(cd.create_dataset_for_client("a"))
    assert [b["x"].tolist() for b in batches] == [[1.0, 2.0], [3.0]]
    assert str(cd.element_spec) == "<x=float32[?]>"
    assert cd.num_examples("a") == 2


def test_preprocess_must_return_dataset():
    cd = _cd().preprocess(lambda ds: [1])
    with pytest.raises(TypeError, match="return a Dataset"):
        cd.create_dataset_for_client("a")


def test_all_clients_concatenated_and_seeded():
    cd = _cd()
    assert [float(e["x"]) for e in cd.create_dataset_from_all_clients()] == [0, 1, 2, 0, 1]
    shuffled = cd.create_dataset_from_all_clients(seed=5)
    assert sorted(float(e["x"]) for e in shuffled) == [0, 0, 1, 1, 2]
    assert str(shuffled.element_spec) == "<x=float32>"


def test_train_test_client_split():
    cd = _cd()
    train, test = ClientData.train_test_client_split(cd, 1, seed=0)
    assert sorted(train.client_ids + test.client_ids) == ["a", "b", "c"]
    assert len(test.client_ids) == 1 and not set(train.client_ids) & set(test.client_ids)
    assert client_data_lib.train_test_client_split(cd, 1, seed=0)[1].client_ids == test.client_ids
    with pytest.raises(ValueError, match="num_test_clients"):
        ClientData.train_test_client_split(cd, 3)


def test_subset_and_repr():
    sub = _cd().subset(["b"])
    assert sub.client_ids == ["b"] and sub.num_examples("b") == 2
    assert "2 clients" in repr(_cd().subset(["a", "b"]))


def test_no_clients_has_no_spec():
    with pytest.raises(ValueError, match="no clients"):
        _ = ClientData([], lambda c: None).element_spec


def test_tffs_spelling_is_answered_with_fedlangs():
    cd = _cd()
    with pytest.raises(AttributeError, match=r"'create_tf_dataset_for_client' \(TFF's spelling\); "
                                             r"fedlang's is create_dataset_for_client\(client_id\)"):
        cd.create_tf_dataset_for_client("a")
    with pytest.raises(AttributeError, match="create_dataset_from_all_clients"):
        cd.create_tf_dataset_from_all_clients()
    with pytest.raises(AttributeError, match=r"^'ClientData' object has no attribute 'nothing'$"):
        cd.nothing  # noqa: B018
