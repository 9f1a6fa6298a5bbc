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
