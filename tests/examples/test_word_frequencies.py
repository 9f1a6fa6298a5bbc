"""Runs examples/word_frequencies.py on a small population."""

import math

import pytest


@pytest.fixture(scope="module")
def example(load_script):
    return load_script("examples/word_frequencies.py")


def test_small_run_finds_the_true_top_words(example, capsys):
    result = example.main(["--clients", "120", "--vocab", "400", "--top-k", "10",
                           "--max-words", "60", "--max-prefixes", "256"])
    assert result["triehh"]["hits"] == 10
    assert result["iblt"]["hits"] == 10
    out = capsys.readouterr().out
    assert "triehh: 10 of the true top 10" in out and "iblt: 10 of the true top 10" in out


def test_data_is_keyboard_like(example):
    clients = example.make_clients(num_clients=50, vocab_size=300, seed=3)
    assert len(clients) == 50 and all(10 <= len(c) <= 200 for c in clients)
    assert len(set(example.make_vocabulary(300))) == 300


def test_privacy_for_spends_the_epsilon(example):
    from fedlang import aggregators

    p = example.privacy_for(3.0, rounds=4, clip=1.0)
    assert aggregators.dp_epsilon(p.noise_multiplier, 1.0, 4, p.delta) == pytest.approx(3.0, rel=1e-3)
    assert example.privacy_for(math.inf, 4, 1.0) is None
