"""The intermediate representation of federated computations.

Every node is immutable, checks its arguments in its constructor, has a read-only
`type_signature`, `children()`, structural equality and hashing, and a compact
`str()` such as `(x -> federated_mean(x))`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from fedlang.core import local, type_format, types

LocalComputation = local.LocalComputation


class Node(types.Frozen):
    """Base class of IR nodes: immutable, compared and hashed by structure (`types.Frozen`)."""

    _label = "IR node "
    _type: types.Type

    @property
    def type_signature(self) -> types.Type:
        return self._type

    def children(self) -> Iterator[Node]:
        """The nodes directly below this one, in order (none for a leaf)."""
        return iter(())


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what} must be a non-empty string, found {name!r}.")
    return name


def _check_type(t: Any, what: str) -> types.Type:
    if not isinstance(t, types.Type):
        raise TypeError(f"{what} must be a fedlang Type, found {t!r}.")
    return t


def _check_node(n: Any, what: str) -> Node:
    if not isinstance(n, Node):
        raise TypeError(f"{what} must be an IR node, found {n!r}.")
    return n


class Reference(Node):
    """A name bound by an enclosing Lambda or Block."""

    def __init__(self, name: str, type_signature: types.Type):
        self.name = _check_name(name, "A reference name")
        self._type = _check_type(type_signature, "Reference type")
        self._freeze()

    def _key(self) -> tuple:
        return (self.name, self._type)

    def __str__(self) -> str:
        return self.name


class Lambda(Node):
    """`(name -> result)`; a parameterless lambda has `parameter_name` None."""

    def __init__(self, parameter_name: str | None, parameter_type: types.Type | None, result: Node):
        if (parameter_name is None) != (parameter_type is None):
            raise TypeError("A Lambda needs both a parameter name and type, or neither.")
        self.parameter_name = parameter_name
        self.parameter_type = (
            None if parameter_type is None else _check_type(parameter_type, "Lambda parameter")
        )
        self.result = _check_node(result, "Lambda result")
        self._type = types.FunctionType(self.parameter_type, result.type_signature)
        self._freeze()

    def children(self) -> Iterator[Node]:
        yield self.result

    def _key(self) -> tuple:
        return (self.parameter_name, self.parameter_type, self.result)

    def __str__(self) -> str:
        return f"({self.parameter_name or ''} -> {self.result})"


class Block(Node):
    """`(let a=..., b=... in result)`: locals are evaluated in order."""

    def __init__(self, locals_: list[tuple[str, Node]], result: Node):
        for name, node in locals_:
            _check_name(name, "A local name")
            _check_node(node, f"Local {name!r}")
        self.locals = tuple(locals_)
        self.result = _check_node(result, "Block result")
        self._type = result.type_signature
        self._freeze()

    def children(self) -> Iterator[Node]:
        for _, node in self.locals:
            yield node
        yield self.result

    def _key(self) -> tuple:
        return (self.locals, self.result)

    def __str__(self) -> str:
        if not self.locals:
            return str(self.result)
        bindings = ",".join(f"{n}={v}" for n, v in self.locals)
        return f"(let {bindings} in {self.result})"


class Call(Node):
    """Applies `function` to `argument` (None for a parameterless function)."""

    def __init__(self, function: Node, argument: Node | None = None):
        _check_node(function, "Call function")
        fn_type = function.type_signature
        if not isinstance(fn_type, types.FunctionType):
            raise TypeError(f"Expected a function to call, found a value of type {fn_type}.")
        if argument is None:
            if fn_type.parameter is not None:
                raise TypeError(
                    f"Function of type {fn_type} needs an argument of type {fn_type.parameter}."
                )
        else:
            _check_node(argument, "Call argument")
            if fn_type.parameter is None:
                raise TypeError(
                    f"Function of type {fn_type} takes no argument, found {argument.type_signature}."
                )
            if not fn_type.parameter.is_assignable_from(argument.type_signature):
                raise TypeError(
                    "Expected an argument of type "
                    f"{type_format.expected_found(fn_type.parameter, argument.type_signature)}."
                )
        self.function = function
        self.argument = argument
        self._type = fn_type.result
        self._freeze()

    def children(self) -> Iterator[Node]:
        yield self.function
        if self.argument is not None:
            yield self.argument

    def _key(self) -> tuple:
        return (self.function, self.argument)

    def __str__(self) -> str:
        return f"{self.function}({'' if self.argument is None else self.argument})"


class Selection(Node):
    """Selects field `index` of a struct-typed `source`."""

    def __init__(self, source: Node, index: int | str):
        _check_node(source, "Selection source")
        st = source.type_signature
        if not isinstance(st, types.StructType):
            raise TypeError(f"Cannot select a field from a value of type {st}; expected a struct.")
        self.source = source
        self.index = st.index_of(index)
        self.name = st.names[self.index]
        self._type = st.types[self.index]
        self._freeze()

    def children(self) -> Iterator[Node]:
        yield self.source

    def _key(self) -> tuple:
        return (self.source, self.index)

    def __str__(self) -> str:
        return (
            f"{self.source}.{self.name}"
            if self.name is not None
            else f"{self.source}[{self.index}]"
        )


class Struct(Node):
    """`<a=x,b=y>`: builds a struct from named or unnamed elements."""

    def __init__(
        self, elements: list[tuple[str | None, Node]], container: types.ContainerSpec | None = None
    ):
        for name, node in elements:
            if name is not None and not isinstance(name, str):
                raise TypeError(f"A struct field name must be a string or None, found {name!r}.")
            _check_node(node, "Struct element")
        self.elements = tuple(elements)
        self._type = types.StructType(
            [(n, v.type_signature) for n, v in elements], container=container
        )
        self._freeze()

    def children(self) -> Iterator[Node]:
        for _, node in self.elements:
            yield node

    def _key(self) -> tuple:
        return self.elements

    def __str__(self) -> str:
        return "<" + ",".join(str(v) if n is None else f"{n}={v}" for n, v in self.elements) + ">"


class Intrinsic(Node):
    """A federated operator from the intrinsic table, at a concrete function type."""

    def __init__(self, uri: str, type_signature: types.FunctionType):
        if not isinstance(uri, str):
            raise TypeError(f"An intrinsic URI must be a string, found {uri!r}.")
        if not isinstance(type_signature, types.FunctionType):
            raise TypeError(f"An intrinsic must have a function type, found {type_signature}.")
        self.uri = uri
        self._type = type_signature
        self._freeze()

    def _key(self) -> tuple:
        return (self.uri, self._type)

    def __str__(self) -> str:
        return self.uri


class Data(Node):
    """A reference to data held outside the IR (e.g. a dataset in a task store)."""

    def __init__(self, uri: str, type_signature: types.Type):
        self.uri = _check_name(uri, "A data URI")
        self._type = _check_type(type_signature, "Data type")
        self._freeze()

    def _key(self) -> tuple:
        return (self.uri, self._type)

    def __str__(self) -> str:
        return f"data<{self.uri}>"


class Literal(Node):
    """A constant tensor embedded in the computation."""

    def __init__(self, value: Any, type_signature: types.TensorType):
        if not isinstance(type_signature, types.TensorType):
            raise TypeError(f"A literal must have a tensor type, found {type_signature}.")
        arr = np.asarray(value, dtype=type_signature.dtype)
        if arr.shape != type_signature.shape:
            raise TypeError(
                f"Literal of shape {arr.shape} does not match its type {type_signature}."
            )
        arr.setflags(write=False)
        self.value = arr
        self._type = type_signature
        self._freeze()

    def _key(self) -> tuple:
        if self.value.dtype.kind == "T":  # string arrays hold pointers: compare the text
            return (self._type, tuple(self.value.ravel().tolist()))
        return (self._type, self.value.tobytes())

    def __str__(self) -> str:
        if self.value.ndim == 0:
            return repr(self.value.item())
        return f"{self._type}{{...}}" if self.value.size > 4 else f"{self.value.tolist()}"


class PlacementLiteral(Node):
    """`CLIENTS` or `SERVER` as a value (an argument of federated_value and federated_eval)."""

    def __init__(self, placement: types.Placement):
        if not isinstance(placement, types.Placement):
            raise TypeError(f"Expected fedlang.CLIENTS or fedlang.SERVER, found {placement!r}.")
        self.placement = placement
        self._type = types.PlacementType()
        self._freeze()

    def _key(self) -> tuple:
        return (self.placement.name,)

    def __str__(self) -> str:
        return self.placement.name


class Local(Node):
    """A local computation from a backend (e.g. a `jax_computation`)."""

    def __init__(self, computation: LocalComputation):
        if not isinstance(computation, LocalComputation):
            raise TypeError(f"Expected a local computation, found {computation!r}.")
        self.computation = computation
        self._type = computation.type_signature
        self._freeze()

    def _key(self) -> tuple:
        return (id(self.computation),)

    def __str__(self) -> str:
        return f"{self.computation.kind}:{self.computation.name}"


def walk(node: Node) -> Iterator[Node]:
    """All nodes of a tree, parents before children."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(list(n.children())))


def free_references(node: Node, bound: frozenset[str] = frozenset()) -> set[str]:
    """The names `node` uses from its environment (not bound by a lambda or block in it).

    A runtime that ships a closure elsewhere (a client task, a Ray actor) sends only
    these names' values.
    """
    if isinstance(node, Reference):
        return set() if node.name in bound else {node.name}
    if isinstance(node, Lambda):
        inner = bound | ({node.parameter_name} if node.parameter_name else set())
        return free_references(node.result, frozenset(inner))
    if isinstance(node, Block):
        free: set[str] = set()
        scope = set(bound)
        for name, value in node.locals:
            free |= free_references(value, frozenset(scope))
            scope.add(name)
        return free | free_references(node.result, frozenset(scope))
    return {n for child in node.children() for n in free_references(child, bound)}
