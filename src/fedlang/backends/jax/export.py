"""Serializing local JAX computations as exported StableHLO (`jax.export`).

Importing this module registers the "jax" codec with `fedlang.core.wire`, so
`computation.to_bytes()` can store the `jax_computation`s a federated computation
calls, and `Computation.from_bytes` can run them in a process that never imports the
Python code that defined them.

A computation is stored as its flat programs (see `backends.jax.computation`): `fn`
when it takes no dataset, else `prologue`, `step` and `epilogue` (only `epilogue` when
it never calls `dataset.reduce`). Each is exported with `jax.export` from abstract
arguments in which unknown (`?`) dimensions are symbolic: the leading unknown
dimensions of the non-dataset arguments share the symbol `a`, those of a dataset
element `b` (so a deserialized computation needs those dimensions to agree at each
call, e.g. a batch of features and its labels; the in-process one does not). Programs are exported for the platforms ("cpu", "cuda") so the bytes run
on either; where JAX cannot lower for both here, for the default platform only (then
they run only on that kind of machine).

Deserialized computations are `ExportedJaxComputation`s: they run anywhere JAX runs
but, unlike the `JaxComputation` they came from, cannot be vmapped or differentiated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from fedlang.backends.jax import computation as jax_backend
from fedlang.backends.jax import verify
from fedlang.core import computation, ir, types, wire

PLATFORMS = ("cpu", "cuda")


def _parts(seq_index: int | None, uses_reduce: bool) -> tuple[str, ...]:
    if seq_index is None:
        return ("fn",)
    return ("prologue", "step", "epilogue") if uses_reduce else ("epilogue",)


def export_programs(comp: jax_backend.JaxComputation) -> dict[str, jax.export.Exported]:
    """Exports the flat programs of `comp` for `PLATFORMS` (else the default platform)."""
    out = {}
    for part, avals in jax_backend.program_avals(comp).items():
        fn = jax.jit(comp.part(part))
        try:
            out[part] = jax.export.export(fn, platforms=PLATFORMS)(*avals)
        except (ValueError, NotImplementedError, RuntimeError):
            # A JAX build that cannot lower for every platform here (e.g. no CUDA
            # lowering rules): export for this machine's platform only.
            out[part] = jax.export.export(fn)(*avals)
    return out


class ExportedJaxComputation(jax_backend.JaxLocal, computation.Computation):
    """A local JAX computation rebuilt from exported StableHLO (see `to_bytes`).

    It runs like the `JaxComputation` it was serialized from (directly or inside
    federated computations) but cannot be vmapped or differentiated.
    """

    # A deserialized Exported has no batching rule ("call_exported"): runtimes must not
    # vmap it (jit and lax.scan work).
    can_vmap = False

    def __init__(
        self,
        name: str,
        parameter_names: tuple[str, ...],
        param_types: tuple[types.Type, ...],
        type_signature: types.FunctionType,
        seq_index: int | None,
        state_type: types.Type | None,
        uses_reduce: bool,
        programs: dict[str, bytes],
        masked: bool = False,
        exported: dict[str, jax.export.Exported] | None = None,
    ):
        self.name = name
        self.parameter_names = parameter_names
        self.param_types = param_types
        self.type_signature = type_signature  # type: ignore[misc]
        self.seq_index = seq_index
        self.state_type = state_type
        self.uses_reduce = uses_reduce
        self.masked = masked
        self.programs = dict(programs)
        self._exported = exported or {
            p: jax.export.deserialize(bytearray(b)) for p, b in programs.items()
        }

    def part(self, name: str) -> Callable[..., list[Any]]:
        if name not in self._exported:
            raise ValueError(
                f"{self.name} has no program {name!r}; it has {sorted(self._exported)}."
            )
        call = self._exported[name].call
        return lambda *leaves: list(call(*leaves))

    def tuned_part(self, name: str) -> Callable[..., list[Any]]:
        return self.part(name)  # StableHLO: nothing for a jaxpr rewrite to see

    def run(self, name: str, leaves: list[Any]) -> list[Any]:
        try:
            return list(super().run(name, leaves))
        except ValueError as e:
            if "polymorphic shapes" not in str(e):
                raise
            raise ValueError(
                f"{self.name} was deserialized from exported StableHLO, in which the unknown "
                "leading dimensions of its non-dataset arguments share one size (and those of a "
                f"dataset element another); found arguments that disagree. JAX said: {e}"
            ) from None

    def to_ir(self) -> ir.Local:
        return ir.Local(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return computation.Computation.__call__(self, *args, **kwargs)


def _encode(comp: Any, ctx: wire.EncodeContext) -> dict[str, Any]:
    if isinstance(comp, ExportedJaxComputation):
        programs = comp.programs
    elif isinstance(comp, jax_backend.JaxComputation):
        programs = {p: bytes(e.serialize()) for p, e in export_programs(comp).items()}
    else:
        raise TypeError(f"Expected a jax_computation, found {comp!r}.")
    return {
        "name": comp.name,
        "parameter_names": list(comp.parameter_names),
        "param_types": [ctx.type_ref(t) for t in comp.param_types],
        "type_signature": ctx.type_ref(comp.type_signature),
        "seq_index": comp.seq_index,
        "state_type": None if comp.state_type is None else ctx.type_ref(comp.state_type),
        "uses_reduce": comp.uses_reduce,
        "masked": bool(getattr(comp, "masked", False)),
        "programs": {p: ctx.add_blob(b) for p, b in programs.items()},
    }


def _decode(meta: dict[str, Any], ctx: wire.DecodeContext) -> ExportedJaxComputation:
    fail = wire.malformed
    name = meta.get("name")
    names = meta.get("parameter_names")
    if not isinstance(name, str) or not (
        isinstance(names, list) and all(isinstance(n, str) for n in names)
    ):
        raise fail("a name and parameter names for a jax computation", repr(meta)[:80])
    param_types = tuple(ctx.type(i) for i in meta.get("param_types") or [])
    signature = ctx.type(meta.get("type_signature"))
    expected_param = computation.parameter_type_for(param_types, names, name)
    if not isinstance(signature, types.FunctionType) or signature.parameter != expected_param:
        raise fail(f"a function type taking {expected_param} for jax computation {name}", signature)
    seq_index, uses_reduce = meta.get("seq_index"), meta.get("uses_reduce")
    if seq_index is not None:
        seq_index = wire.check_int(seq_index, "the dataset parameter index", 0, len(names))
        if not isinstance(param_types[seq_index], types.SequenceType):
            raise fail(f"a sequence type at parameter {seq_index}", param_types[seq_index])
    if not isinstance(uses_reduce, bool):
        raise fail("a boolean uses_reduce", repr(uses_reduce))
    masked = meta.get("masked", False)
    if not isinstance(masked, bool):
        raise fail("a boolean masked", repr(masked))
    state = meta.get("state_type")
    state_type = None if state is None else ctx.type(state)
    if uses_reduce and seq_index is not None and state_type is None:
        raise fail(f"a state type for jax computation {name}, which reduces its dataset", None)
    programs = meta.get("programs")
    parts = _parts(seq_index, uses_reduce)
    if not isinstance(programs, dict) or sorted(programs) != sorted(parts):
        found = sorted(programs) if isinstance(programs, dict) else programs
        raise fail(f"the programs {list(parts)} for jax computation {name}", found)
    blobs = {p: ctx.blob(programs[p]) for p in parts}
    expected = verify.expected_programs(
        param_types, signature.result, seq_index, state_type, uses_reduce
    )
    if not ctx.trusted:
        # Untrusted bytes reach jaxlib in this process only after another process has
        # loaded, compiled and run them without harm.
        verify.checker().check(name, blobs, expected)
    exported = {}
    for part, blob in blobs.items():
        try:
            exported[part] = jax.export.deserialize(bytearray(blob))
        except Exception as e:  # any parse failure of the flatbuffer means damaged bytes
            raise fail(
                f"exported StableHLO for the {part} program of jax computation {name}",
                f"unreadable bytes ({type(e).__name__}: {e})",
            ) from e
        verify.check_loaded(name, part, exported[part], expected[part])
    return ExportedJaxComputation(
        name,
        tuple(names),
        param_types,
        signature,
        seq_index,
        state_type,
        uses_reduce,
        blobs,
        masked,
        exported,
    )


wire.register_local_codec("jax", _encode, _decode)
