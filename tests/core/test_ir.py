import numpy as np
import pytest

from fedlang.core import ir, types

F32 = types.TensorType(np.float32)
AT_CLIENTS = types.type_at_clients(F32)
MEAN = ir.Intrinsic("federated_mean", types.FunctionType(AT_CLIENTS, types.type_at_server(F32)))


def _mean_of_x() -> ir.Lambda:
    return ir.Lambda("x", AT_CLIENTS, ir.Call(MEAN, ir.Reference("x", AT_CLIENTS)))


def test_nodes_print_compactly():
    assert str(_mean_of_x()) == "(x -> federated_mean(x))"
    assert repr(ir.Reference("x", AT_CLIENTS)) == "Reference(x)"
    assert str(ir.Data("store://a", AT_CLIENTS)) == "data<store://a>"
    assert str(ir.Block([("y", ir.Reference("x", F32))], ir.Reference("y", F32))) == (
        "(let y=x in y)"
    )


def test_nodes_are_compared_and_hashed_by_structure():
    # arrange
    a, b = _mean_of_x(), _mean_of_x()
    # act / assert
    assert a == b and hash(a) == hash(b)
    assert ir.Reference("x", F32) != ir.Reference("y", F32)
    assert ir.Reference("x", F32) != ir.Reference("x", AT_CLIENTS)
    assert ir.Data("x", F32) != ir.Reference("x", F32)  # same fields, another kind of node
    assert ir.Literal(1.0, F32) == ir.Literal(np.float32(1.0), F32)
    assert len({a, b, ir.Reference("x", F32)}) == 2


def test_nodes_are_immutable():
    node = ir.Reference("x", F32)
    with pytest.raises(AttributeError, match=r"^IR node Reference is immutable$"):
        node.name = "y"
    with pytest.raises(AttributeError, match=r"^IR node Lambda is immutable$"):
        _mean_of_x().result = node


def test_leaves_have_no_children_and_parents_list_theirs_in_order():
    x = ir.Reference("x", AT_CLIENTS)
    assert list(x.children()) == []
    assert list(ir.Call(MEAN, x).children()) == [MEAN, x]
    assert [str(n) for n in ir.walk(_mean_of_x())] == [
        "(x -> federated_mean(x))",
        "federated_mean(x)",
        "federated_mean",
        "x",
    ]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ir.Reference("", F32), "A reference name must be a non-empty string, found ''."),
        (lambda: ir.Reference(3, F32), "A reference name must be a non-empty string, found 3."),
        (lambda: ir.Data("", F32), "A data URI must be a non-empty string, found ''."),
        (
            lambda: ir.Block([(None, ir.Reference("x", F32))], ir.Reference("x", F32)),
            "A local name must be a non-empty string, found None.",
        ),
        (lambda: ir.Reference("x", np.float32), "Reference type must be a fedlang Type"),
    ],
)
def test_constructors_check_their_arguments(build, message):
    with pytest.raises(TypeError) as e:
        build()
    assert str(e.value).startswith(message)
