import collections

import numpy as np

from fedlang.core import types
from fedlang.simulation import specs


def test_leaf_spec_of_values():
    assert specs.leaf_spec(np.zeros((2, 3), np.float32)) == types.TensorType(np.float32, (2, 3))
    assert specs.leaf_spec("abc") == specs.StringSpec(())
    assert specs.leaf_spec(np.array(["a", "b"])) == specs.StringSpec((2,))


def test_string_spec_str():
    assert str(specs.StringSpec(())) == "string"
    assert str(specs.StringSpec((None,))) == "string[?]"


def test_structure_of_namedtuple_and_element_type():
    point = collections.namedtuple("Point", ["x", "y"])
    structure = specs.structure_of(point(np.float32(1), np.int32(2)))
    assert specs.structure_str(structure) == "<x=float32,y=int32>"
    assert str(specs.element_type(structure)) == "<x=float32,y=int32>"


def test_to_structure_pairs_and_strings():
    structure = specs.to_structure({"p": (np.float32, [28, 28]), "s": str})
    assert structure == {"p": types.TensorType(np.float32, (28, 28)), "s": specs.StringSpec(())}
