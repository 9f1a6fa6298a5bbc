"""Exporting flat JAX programs to ONNX, and checking them against JAX with onnxruntime.

A program is a function of flat arrays returning a list of arrays (a local computation's
`part`, or several fused, see `task.py`). `export` converts it with jax2onnx after
fedlang's rewrites (`rules.py`), keeping unknown dimensions (the batch) symbolic;
`session` and `run` run a model with onnxruntime (on the CPU, as the browser's
WebAssembly backend does), `difference` measures how far its outputs are from JAX's.

jax2onnx registers a converter per primitive when its plugins are imported. Importing all
of them imports Flax, Equinox and other libraries' plugins too (about 30 s); fedlang
imports only the plugins of JAX's own primitives (about 5 s), once per process.
"""

from __future__ import annotations

import importlib
import pathlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from fedlang.deploy.browser import rules

JAX2ONNX_VERSION = "0.17.1"  # the version the rules in rules.py were written for
OPSET = 23  # jax2onnx 0.17.1's default; onnxruntime-web 1.30 runs it
TOLERANCE = 1e-4

_lock = threading.Lock()
_supported: frozenset[str] | None = None


class BrowserExportError(TypeError):
    """A computation that browser clients cannot run (the message says what and why)."""


def _missing(what: str, e: Exception) -> BrowserExportError:
    return BrowserExportError(
        f"Expected {what} to export client work for browsers, found it missing ({e}); "
        "install the extra: pip install 'fedlang[browser]'."
    )


def converter() -> Any:
    """jax2onnx's `to_onnx`, with the converters of JAX's primitives registered."""
    global _supported
    with _lock:
        try:
            import jax2onnx
            from jax2onnx.plugins import plugin_system
        except ImportError as e:
            raise _missing(f"jax2onnx {JAX2ONNX_VERSION}", e) from e
        if _supported is None:
            if not plugin_system._already_imported_plugins:
                root = pathlib.Path(plugin_system.__file__).parent
                for py in sorted((root / "jax").rglob("*.py")):
                    if py.name != "__init__.py":
                        parts = py.relative_to(root).with_suffix("").parts
                        importlib.import_module(".".join(("jax2onnx.plugins", *parts)))
                plugin_system._already_imported_plugins = True
            _supported = frozenset(plugin_system.PLUGIN_REGISTRY)
        return jax2onnx.to_onnx


def supported_primitives() -> frozenset[str]:
    """The primitives jax2onnx has a converter for."""
    converter()
    assert _supported is not None
    return _supported


def symbolic_specs(avals: Sequence[jax.ShapeDtypeStruct]) -> list[jax.ShapeDtypeStruct]:
    """jax2onnx input specs: each unknown dimension named by its symbol (e.g. `b`)."""
    return [
        jax.ShapeDtypeStruct(tuple(d if isinstance(d, int) else str(d) for d in a.shape), a.dtype)
        for a in avals
    ]


def check_program(fn: Callable[..., Sequence[Any]], avals: Sequence[jax.ShapeDtypeStruct],
                  name: str) -> set[str]:
    """Refuses a program with a primitive that cannot be exported; returns the rules it
    needs.

    Raises:
      BrowserExportError: naming the primitive (and the program).
    """
    supported = supported_primitives()
    jaxpr = jax.make_jaxpr(lambda *xs: list(fn(*xs)))(*avals).jaxpr
    try:
        rules.check(jaxpr, supported)
    except rules.UnsupportedPrimitive as e:
        raise BrowserExportError(f"{e} (in {name})") from e
    return rules.rules_used(jaxpr)


def export(fn: Callable[..., Sequence[Any]], avals: Sequence[jax.ShapeDtypeStruct],
           input_names: Sequence[str], output_names: Sequence[str], name: str) -> bytes:
    """The ONNX model (bytes) of a flat program, unknown dimensions kept symbolic.

    Raises:
      BrowserExportError: when the converter fails (the message names the program).
    """
    to_onnx = converter()
    try:
        model = to_onnx(rules.rewrite(fn), symbolic_specs(avals), model_name=name, opset=OPSET)
    except rules.UnsupportedPrimitive as e:
        raise BrowserExportError(f"{e} (in {name})") from e
    except Exception as e:  # the converter's own failures: name what failed
        raise BrowserExportError(
            f"Expected jax2onnx to convert {name} to ONNX, found it failing: "
            f"{type(e).__name__}: {e}"
        ) from e
    _name_io(model, input_names, output_names)
    _fill_constants(model)
    return bytes(model.SerializeToString())


def _fill_constants(model: Any, smallest: int = 64) -> None:
    """Replaces each constant tensor of one repeated value (the converter folds
    `jnp.zeros_like(weights)` into a copy of the weights' size) by a `ConstantOfShape`
    node: a CNN's programs shrink from megabytes to kilobytes (in place)."""
    from onnx import numpy_helper

    graph = model.graph
    kept, fills = [], []
    for init in graph.initializer:
        array = numpy_helper.to_array(init)
        if _uniform(array, smallest):
            fills += _fill(init.name, array)
        else:
            kept.append(init)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    nodes = list(fills)
    for node in graph.node:
        if node.op_type == "Constant" and [a.name for a in node.attribute] == ["value"]:
            array = numpy_helper.to_array(node.attribute[0].t)
            if _uniform(array, smallest):
                nodes += _fill(node.output[0], array)
                continue
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _uniform(array: np.ndarray, smallest: int) -> bool:
    return bool(array.size >= smallest and array.dtype.kind in "fiub"
                and np.all(array == array.flat[0]))


def _fill(name: str, array: np.ndarray) -> list[Any]:
    """Nodes making `name`: a tensor of `array`'s shape filled with its value."""
    from onnx import helper, numpy_helper

    shape = numpy_helper.from_array(np.asarray(array.shape, np.int64), f"{name}__shape")
    value = numpy_helper.from_array(array.reshape(-1)[:1].copy(), f"{name}__value")
    return [
        helper.make_node("Constant", [], [f"{name}__shape"], value=shape),
        helper.make_node("ConstantOfShape", [f"{name}__shape"], [name], value=value),
    ]


def _name_io(model: Any, input_names: Sequence[str], output_names: Sequence[str]) -> None:
    """Names the model's inputs and outputs (in place). Each output gets an Identity node
    of its own, so an output that is an input, or twice the same value, is still a
    distinct name."""
    from onnx import helper

    graph = model.graph
    if len(graph.input) != len(input_names) or len(graph.output) != len(output_names):
        raise BrowserExportError(
            f"Expected the ONNX model to have {len(input_names)} inputs and {len(output_names)} "
            f"outputs, found {len(graph.input)} and {len(graph.output)}."
        )
    renamed = {i.name: new for i, new in zip(graph.input, input_names)}
    _rename_uses(graph, renamed)
    for i in graph.input:
        i.name = renamed[i.name]
    outputs = list(graph.output)
    del graph.output[:]
    for out, new in zip(outputs, output_names):
        graph.node.append(helper.make_node("Identity", [renamed.get(out.name, out.name)], [new]))
        info = type(out)()
        info.CopyFrom(out)
        info.name = new
        graph.output.append(info)


def _rename_uses(graph: Any, renamed: dict[str, str]) -> None:
    from onnx import AttributeProto

    for node in graph.node:
        node.input[:] = [renamed.get(x, x) for x in node.input]
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                _rename_uses(attr.g, renamed)
            elif attr.type == AttributeProto.GRAPHS:
                for g in attr.graphs:
                    _rename_uses(g, renamed)


def random_inputs(avals: Sequence[jax.ShapeDtypeStruct], sizes: dict[str, int],
                  rng: np.random.Generator) -> list[np.ndarray]:
    """Random arrays for abstract values; each symbolic dimension takes its size in
    `sizes`. Floats are standard normal, integers in [0, 10), booleans fair coins."""
    out = []
    for a in avals:
        shape = tuple(d if isinstance(d, int) else sizes[str(d)] for d in a.shape)
        dt = np.dtype(a.dtype)
        if dt.kind == "f":
            out.append(rng.standard_normal(shape).astype(dt))
        elif dt.kind in "iu":
            out.append(rng.integers(0, 10, shape).astype(dt))
        elif dt.kind == "b":
            out.append(rng.random(shape) < 0.5)
        else:
            raise BrowserExportError(f"Expected tensors of real numbers, found dtype {dt}.")
    return out


def session(model: bytes) -> Any:
    """An onnxruntime session on the CPU (what the browser's wasm backend runs)."""
    try:
        import onnxruntime
    except ImportError as e:
        raise _missing("onnxruntime", e) from e
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    try:
        return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise BrowserExportError(
            f"Expected onnxruntime to load the exported model, found: {type(e).__name__}: {e}"
        ) from e


def run(sess: Any, names: Sequence[str], arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Runs a session on arrays given by input name (inputs the model dropped are left out)."""
    wanted = {i.name for i in sess.get_inputs()}
    feeds = {n: a for n, a in zip(names, arrays) if n in wanted}
    return list(sess.run(None, feeds))


def difference(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference between two arrays, relative to the larger of 1 and the
    largest magnitude in `want` (NaN where `want` is NaN counts as equal; a shape
    difference is infinite)."""
    if got.shape != want.shape:
        return float("inf")
    g, w = got.astype(np.float64), want.astype(np.float64)
    diff = np.where(np.isnan(g) & np.isnan(w), 0.0, np.abs(g - w))
    if not diff.size:
        return 0.0
    finite = np.abs(w[np.isfinite(w)])
    scale = max(1.0, float(finite.max()) if finite.size else 1.0)
    return float(np.max(diff)) / scale
