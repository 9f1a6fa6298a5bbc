"""`Computation`: a typed function that runs in the current execution context."""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from fedlang.core import context, ir, types, wire


class Computation(abc.ABC):
    """A typed, traced function. Call it like a Python function.

    Attributes:
      type_signature: its `FunctionType`, e.g. `({float32}@CLIENTS -> float32@SERVER)`.
      name: the name of the Python function it was made from.
      parameter_names: the names of its Python parameters; with two or more, the
        parameter type is a struct of them and calls take them positionally or by name.
    """

    name: str
    parameter_names: tuple[str, ...]
    type_signature: types.FunctionType

    @abc.abstractmethod
    def to_ir(self) -> ir.Lambda | ir.Local:
        """The IR of this computation: a `Lambda` or a `Local` node."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arg = pack_args(
            self.type_signature.parameter, self.parameter_names, args, kwargs, self.name
        )
        return context.get_context().invoke(self, arg)

    def to_bytes(self) -> bytes:
        """Serializes this computation: its IR and the local computations it calls, in
        the binary format of `fedlang.core.wire`.

        Raises:
          SerializationError: if a local computation's backend has no registered codec.
        """
        return wire.encode_computation(self.to_ir(), self.name, self.parameter_names)

    @staticmethod
    def from_bytes(
        data: bytes, *, public_key: Any = None, trusted: bool = False, max_bytes: int | None = None
    ) -> Computation:
        """Rebuilds a computation serialized with `to_bytes`, in any process.

        A computation embeds native programs (the JAX backend's StableHLO), which a
        damaged or crafted file could use to crash or hijack the process that parses
        them. So bytes are handed to a native parser here only when they are trusted:

        * `public_key=...`: `data` must be signed (`fedlang.core.signing.sign`) by that
          key's private half; the signature is checked before anything is parsed.
        * `trusted=True`: the caller vouches for the bytes (it wrote them itself).
        * otherwise each embedded program is first checked in a separate process
          (loaded, compared with the declared types, compiled and run once on zeros);
          only if that process survives and agrees is it loaded here. This costs a
          process start.

        In every case each program's argument and result types must match the signature
        it declares, and its custom calls must be on the backend's allow-list.
        `max_bytes`, if given, bounds the bytes of the tensors it holds.

        Raises:
          SerializationError: if the bytes are malformed, truncated, from a newer
            version, unsigned or signed by another key (with `public_key`), name an
            unknown intrinsic or backend, do not type-check, or embed a program that
            fails its check.
        """
        root, name, names = wire.decode_computation(
            data, public_key=public_key, trusted=trusted, max_bytes=max_bytes
        )
        if isinstance(root, ir.Lambda):
            return IRComputation(root, name, names)
        if isinstance(root, ir.Local) and isinstance(root.computation, Computation):
            return root.computation
        raise wire.malformed(
            "a Lambda or a local computation at the root of the IR", type(root).__name__
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {self.type_signature}>"

    def __str__(self) -> str:
        return f"{self.name}: {self.type_signature}"


class IRComputation(Computation):
    """A computation given by an IR `Lambda` (what `federated_computation` traces to)."""

    def __init__(self, lambda_: ir.Lambda, name: str, parameter_names: Sequence[str] = ()):
        if not isinstance(lambda_, ir.Lambda):
            raise TypeError(f"Expected an IR Lambda, found {lambda_!r}.")
        self.ir = lambda_
        self.name = name
        self.parameter_names = tuple(parameter_names)

    @property  # type: ignore[override]
    def type_signature(self) -> types.FunctionType:  # type: ignore[override]
        return self.ir.type_signature  # type: ignore[return-value]

    def to_ir(self) -> ir.Lambda:
        return self.ir

    def compact_str(self) -> str:
        """The IR in TFF's compact notation, e.g. `(arg -> federated_mean(arg))`."""
        return str(self.ir)


def parameter_names_of(fn: Callable) -> tuple[str, ...]:
    """Positional parameter names of a Python function; rejects *args/**kwargs."""
    names = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(
                f"{getattr(fn, '__name__', fn)} takes *{p.name}; computations need a fixed list of parameters."
            )
        names.append(p.name)
    return tuple(names)


def parameter_type_for(
    param_types: Sequence[Any], names: Sequence[str], fn_name: str
) -> types.Type | None:
    """The parameter type of a computation from the types given to its decorator."""
    if len(param_types) != len(names):
        raise TypeError(
            f"{fn_name} has {len(names)} parameter(s) {list(names)} but {len(param_types)} type(s) were given."
        )
    if not param_types:
        return None
    if len(param_types) == 1:
        return types.to_type(param_types[0])
    return types.StructType([(n, types.to_type(t)) for n, t in zip(names, param_types)])


def pack_args(
    parameter: types.Type | None,
    names: Sequence[str],
    args: tuple,
    kwargs: dict[str, Any],
    fn_name: str,
) -> Any:
    """Packs call arguments into one value for the parameter type (a tuple for several)."""
    given = len(args) + len(kwargs)
    if parameter is None:
        if given:
            raise TypeError(f"{fn_name} takes no arguments, found {given}.")
        return None
    if len(names) <= 1:
        if given != 1:
            raise TypeError(f"{fn_name} takes 1 argument of type {parameter}, found {given}.")
        return args[0] if args else next(iter(kwargs.values()))
    if given != len(names):
        raise TypeError(
            f"{fn_name} takes {len(names)} arguments {list(names)} of type {parameter}, found {given}."
        )
    packed = list(args) + [None] * (len(names) - len(args))
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"{fn_name} has no parameter {k!r}; its parameters are {list(names)}.")
        i = names.index(k)
        if i < len(args):
            raise TypeError(f"{fn_name} got two values for parameter {k!r}.")
        packed[i] = v
    return tuple(packed)
