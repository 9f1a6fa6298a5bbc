"""Runs examples/sparse_embeddings.py on small settings."""

import pathlib

import pytest

PATH = pathlib.Path(__file__).resolve().parents[2] / "examples" / "sparse_embeddings.py"


@pytest.fixture(scope="module")
def example(load_script):
    return load_script("examples/sparse_embeddings.py")


def test_sparse_embeddings_learns_and_uploads_only_rows(example):
    out = example.main(
        vocab=50_000,
        num_clients=6,
        rows_per_client=100,
        docs_per_client=32,
        rounds=3,
        verbose=False,
    )
    assert out["losses"][-1] < out["losses"][0]
    assert out["accuracies"][-1] > out["accuracies"][0] + 0.2
    assert out["dense_bytes_per_client"] >= 90 * out["sparse_bytes_per_client"]  # 5e4 / (5 * 100)
