import collections

from fedlang.simulation import _tree


def test_flatten_unflatten_keeps_order_and_containers():
    point = collections.namedtuple("Point", ["a", "b"])
    struct = {"z": 1, "a": (2, [3, point(4, 5)])}
    leaves = _tree.flatten(struct)
    assert leaves == [1, 2, 3, 4, 5]
    rebuilt = _tree.unflatten(struct, [x * 10 for x in leaves])
    assert rebuilt == {"z": 10, "a": (20, [30, point(40, 50)])}
    assert list(rebuilt) == ["z", "a"] and isinstance(rebuilt["a"][1][1], point)
    assert _tree.paths(struct) == ["z", "a/0", "a/1/0", "a/1/1/0", "a/1/1/1"]
    assert _tree.paths(7) == [""]
