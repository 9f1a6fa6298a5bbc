import doctest

import pytest

from fedlang.deploy.secagg import graph

IDS = [f"client-{i:03d}" for i in range(100)]


def test_the_graph_is_regular_symmetric_and_without_self_loops():
    g = graph.neighbours(IDS, degree=10, round_id=b"round")
    assert set(g) == set(IDS)
    for c, near in g.items():
        assert len(near) == len(set(near)) == 10
        assert c not in near
        assert all(c in g[v] for v in near)


def test_the_graph_is_a_function_of_the_round_id_and_the_clients():
    a = graph.neighbours(IDS, degree=10, round_id=b"round")
    assert a == graph.neighbours(list(reversed(IDS)), degree=10, round_id=b"round")
    assert a != graph.neighbours(IDS, degree=10, round_id=b"other round")
    assert a != graph.neighbours(IDS[:-1], degree=10, round_id=b"round")


def test_the_ring_is_shuffled_not_the_sorted_order():
    g = graph.neighbours(IDS, degree=2, round_id=b"round")
    sorted_ring_pairs = sum(IDS[i + 1] in g[IDS[i]] for i in range(len(IDS) - 1))
    assert sorted_ring_pairs < 10  # a sorted ring would link all 99 consecutive pairs


def test_a_degree_of_n_minus_1_or_more_is_the_complete_graph():
    g = graph.neighbours(["a", "b", "c", "d"], degree=6, round_id=b"r")
    assert g == {
        "a": ("b", "c", "d"),
        "b": ("a", "c", "d"),
        "c": ("a", "b", "d"),
        "d": ("a", "b", "c"),
    }
    assert graph.neighbours(["solo"], degree=0, round_id=b"r") == {"solo": ()}


def test_odd_degrees_and_repeated_ids_are_refused():
    with pytest.raises(ValueError, match="even degree"):
        graph.neighbours(IDS, degree=3, round_id=b"r")
    with pytest.raises(ValueError, match="distinct client ids"):
        graph.neighbours(["a", "a", "b"], degree=2, round_id=b"r")


def test_docstring_examples_run():
    assert doctest.testmod(graph).failed == 0
