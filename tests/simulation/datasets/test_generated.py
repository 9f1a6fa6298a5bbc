import numpy as np
import pytest

from fedlang.simulation.datasets import generated


def test_synthetic_shapes_and_determinism():
    cd = generated.synthetic(0.5, 0.5, num_clients=5, seed=1)
    assert str(cd.element_spec) == "<x=float32[60],y=int32>"
    sizes = [cd.num_examples(c) for c in cd.client_ids]
    assert all(s >= 50 for s in sizes)
    first = next(iter(cd.create_dataset_for_client("2").batch(1000)))
    again = next(iter(generated.synthetic(0.5, 0.5, num_clients=5, seed=1).create_dataset_for_client("2").batch(1000)))
    np.testing.assert_array_equal(first["x"], again["x"])
    assert len(first["y"]) == sizes[2] and first["y"].max() < 10


def test_synthetic_feature_means_spread_with_beta():
    def spread(beta):
        cd = generated.synthetic(0.0, beta, num_clients=10, examples_per_client=[200] * 10, seed=0)
        means = [next(iter(ds.batch(200)))["x"].mean() for ds in cd.datasets()]
        return np.std(means)

    assert spread(0.0) < spread(5.0)
    with pytest.raises(ValueError, match="sizes"):
        generated.synthetic(0, 0, num_clients=2, examples_per_client=[1])


def test_digits_partitions():
    cd = generated.digits(num_clients=5, partition="dirichlet", alpha=0.5, seed=0)
    assert str(cd.element_spec) == "<x=float32[64],y=int32>"
    assert sum(cd.num_examples(c) for c in cd.client_ids) == 1797
    batch = next(iter(cd.create_dataset_for_client("0").batch(10)))
    assert batch["x"].min() >= 0.0 and batch["x"].max() <= 1.0
    for partition in ("iid", "shards", "pathological"):
        assert len(generated.digits(5, partition=partition).client_ids) == 5
    with pytest.raises(ValueError, match="partition"):
        generated.digits(5, partition="zipf")


def test_digits_train_test_split_per_client():
    train, test = generated.digits_train_test(num_clients=4, test_fraction=0.25, seed=0)
    assert train.client_ids == test.client_ids
    total = sum(train.num_examples(c) + test.num_examples(c) for c in train.client_ids)
    assert total == 1797
    assert all(test.num_examples(c) >= 1 for c in test.client_ids)
