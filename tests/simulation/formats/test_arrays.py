import numpy as np
import pytest

from fedlang.simulation import partitioners
from fedlang.simulation.formats import arrays


def test_from_numpy_with_partition():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10, dtype=np.int32)
    cd = arrays.from_numpy(x, y, partitioners.iid(10, 3, seed=0))
    assert str(cd.element_spec) == "<x=float32[2],y=int32>"
    seen = sorted(int(e["y"]) for ds in cd.datasets() for e in ds)
    assert seen == list(range(10))
    assert sum(cd.num_examples(c) for c in cd.client_ids) == 10


def test_from_numpy_without_labels_and_errors():
    cd = arrays.from_numpy(np.zeros((4, 3)), None, {"a": [0, 1], "b": []})
    assert list(cd.create_dataset_for_client("b")) == []
    with pytest.raises(ValueError, match="same number of rows"):
        arrays.from_numpy(np.zeros(3), np.zeros(4), {"a": [0]})
    with pytest.raises(ValueError, match=r"indices in \[0, 3\)"):
        arrays.from_numpy(np.zeros(3), None, {"a": [5]})
    with pytest.raises(ValueError, match=r"partitioners\.iid"):
        arrays.from_numpy(np.zeros(3))


def test_from_numpy_accepts_a_list_of_index_lists():
    # Before: AttributeError: 'list' object has no attribute 'items'.
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    cd = arrays.from_numpy(x, np.arange(5), [[0, 1, 2], [3, 4]])
    assert cd.client_ids == ["0", "1"] and cd.num_examples("1") == 2
    assert [int(e["y"]) for e in cd.create_dataset_for_client("1")] == [3, 4]
    assert arrays.from_numpy(x, None, np.array([[0, 1], [2, 3]])).client_ids == ["0", "1"]


@pytest.mark.parametrize("partition, message", [
    ([0, 1, 2], r"list of index lists \(one per client\), found a list of int.*\[\[0, 1, 2\]\]"),
    (3, r"found int"),
    ({"a": [0.5, 1.0]}, r"integer indices for client 'a', found float64"),
    ({"a": [True, False]}, r"integer indices for client 'a', found bool.*np\.flatnonzero"),
])
def test_from_numpy_refuses_other_partitions(partition, message):
    with pytest.raises(TypeError, match=message):
        arrays.from_numpy(np.zeros((3, 2)), None, partition)
