"""A round's client task for browsers: ONNX programs and a JSON description to run them.

A browser cannot run the plan's StableHLO task, so the driver adds to the plan what a
browser needs (`browser_task(plan)`), signed with it:

* `programs`: ONNX models (base64), each a flat program of tensors;
* `run`: the steps in order, over numbered tensor *slots*: `{"kind": "run", "program",
  "inputs": {name: slot}, "outputs": {name: slot}}` runs a program once; `{"kind": "loop",
  "dataset", "program", "inputs", "outputs", "batch": {name: path}, "mask"}` runs a
  dataset reduce's step program once per batch of the page's dataset, its outputs
  becoming the state slots read by the next batch;
* `broadcast`: the slots of the broadcast value's tensors, in the value format's order;
  `consts`: slots with constant values; `slots`: each slot's dtype and shape;
* `report`: how to pre-aggregate, as `execution.run_plan_parts` does: the header of the
  report in the binary value format (`RoundPlan.report_type`: each total in the model's
  dtype, float32 for a float32 model, as a Python client reports it), and per tensor of
  the report where its values come from (`{"slot": s}` converted to the header's dtype,
  `{"slot": s, "times": w}` the float32 product with the weight in slot `w`, as a
  weighted mean's total, or `{"value": v}` a count of 1 or a "seen" flag);
* `state` (only for a task with client state): `name`, the slots the stored state is
  fed to (`inputs`, in the value format's order), the slots of the new state
  (`outputs`, empty when the task does not write it), its `header` in the binary value
  format and `initial`, a first-seen client's state (that format, base64). The page
  keeps the state in IndexedDB (`fedlang.js`'s `StateStore`) and replaces it once the
  server acknowledged the report.

The task's IR is evaluated symbolically: selections and structs only rename slots, a
call of a lambda is inlined, a call of a JAX local computation becomes a call of one of
its programs (`fn`, or `prologue`, then a loop of `step`, then `epilogue` for a dataset
reduce). Consecutive calls outside loops are fused into one program, so a FedAvg task is
three ONNX programs: before the loop, the step, after the loop.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import numpy as np

from fedlang.backends.jax import computation as jax_backend
from fedlang.core import intrinsic_defs, ir, local, serialization, structure, types
from fedlang.deploy.browser import onnx_export
from fedlang.deploy.plans import round as plan_lib

FORMAT = "fedlang-browser-task"
VERSION = 1
Error = onnx_export.BrowserExportError

# Aggregations a browser pre-aggregates, by intrinsic: the partial is `kind`'s recipe.
KINDS = {
    intrinsic_defs.FEDERATED_SUM.uri: "sum",
    intrinsic_defs.FEDERATED_MEAN.uri: "mean",
    intrinsic_defs.FEDERATED_WEIGHTED_MEAN.uri: "weighted_mean",
    intrinsic_defs.FEDERATED_MIN.uri: "extremum",
    intrinsic_defs.FEDERATED_MAX.uri: "extremum",
    intrinsic_defs.FEDERATED_AGGREGATE.uri: "aggregate",
}
DTYPES = ("float32", "int32", "int64", "int8", "uint8", "bool")  # what the page holds


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A client dataset in the symbolic evaluation (its elements reach programs as batches)."""

    name: str
    element: types.Type


@dataclasses.dataclass(frozen=True)
class Closure:
    fn: ir.Lambda
    env: dict[str, Any]


@dataclasses.dataclass
class Call:
    """One program of a local computation on slots."""

    comp: Any
    part: str
    inputs: list[int]
    outputs: list[int]


@dataclasses.dataclass
class Loop:
    """A dataset reduce's step, once per batch: `state = step(args, state, batch, mask)`."""

    comp: Any
    dataset: Dataset
    args: list[int]
    state: list[int]


class Compiler:
    """Evaluates a client task's IR over slots (see the module docstring)."""

    def __init__(self) -> None:
        self.slots: list[tuple[types.TensorType, str]] = []
        self.consts: dict[int, np.ndarray] = {}
        self.ops: list[Call | Loop] = []

    def new(self, t: types.Type, label: str) -> Any:
        """Fresh slots for a value of type `t` (a tree of slot numbers)."""
        leaves = []
        for lt, path in zip(_leaf_types(t, label), _paths(t)):
            leaves.append(len(self.slots))
            where = "".join(f".{k}" if isinstance(k, str) else f"[{k}]" for k in path)
            self.slots.append((lt, f"{label}{where}"))
        return structure.unflatten(leaves, t)

    def const(self, value: Any, t: types.Type, label: str) -> Any:
        tree = self.new(t, label)
        for slot, leaf in zip(structure.flatten(tree, t), structure.flatten(value, t)):
            self.consts[slot] = np.asarray(leaf, self.slots[slot][0].dtype)
        return tree

    def eval(self, node: ir.Node, env: dict[str, Any]) -> Any:
        if isinstance(node, ir.Reference):
            return env[node.name]
        if isinstance(node, ir.Selection):
            return self.eval(node.source, env)[node.index]
        if isinstance(node, ir.Struct):
            return tuple(self.eval(v, env) for _, v in node.elements)
        if isinstance(node, ir.Block):
            inner = dict(env)
            for name, value in node.locals:
                inner[name] = self.eval(value, inner)
            return self.eval(node.result, inner)
        if isinstance(node, ir.Lambda):
            return Closure(node, env)
        if isinstance(node, ir.Local):
            return node.computation
        if isinstance(node, ir.Literal):
            return self.const(node.value, node.type_signature, "a literal")
        if isinstance(node, ir.Call):
            fn = self.eval(node.function, env)
            arg = None if node.argument is None else self.eval(node.argument, env)
            return self.apply(fn, arg, node.type_signature)
        what = node.uri if isinstance(node, ir.Intrinsic | ir.Data) else type(node).__name__
        raise Error(
            f"Expected client work of local computations, selections and structs, found {what} "
            "in the client task; browsers run only that. Train such clients with the Python "
            "client (fedlang client)."
        )

    def apply(self, fn: Any, arg: Any, result_t: types.Type) -> Any:
        if isinstance(fn, Closure):
            env = dict(fn.env)
            if fn.fn.parameter_name is not None:
                env[fn.fn.parameter_name] = arg
            return self.eval(fn.fn.result, env)
        if local.is_program(fn) and fn.kind == "jax" and fn.can_vmap:
            return self._local(fn, arg, result_t)
        raise Error(
            f"Expected a JAX local computation in the client task, found {fn!r}; browsers run "
            "only JAX computations (exported to ONNX)."
        )

    def _local(self, comp: Any, arg: Any, result_t: types.Type) -> Any:
        args = comp.split_arg(arg)
        leaves = [
            slot for i, (a, t) in enumerate(zip(args, comp.param_types)) if i != comp.seq_index
            for slot in structure.flatten(a, t)
        ]
        out = self.new(result_t, comp.name)
        out_slots = structure.flatten(out, result_t)
        if comp.seq_index is None:
            self.ops.append(Call(comp, "fn", leaves, out_slots))
            return out
        if not comp.uses_reduce:
            self.ops.append(Call(comp, "epilogue", leaves, out_slots))
            return out
        dataset = args[comp.seq_index]
        if not isinstance(dataset, Dataset):
            raise Error(f"Expected {comp.name} to reduce a client dataset, found {dataset!r}.")
        state_t = cast(types.Type, comp.state_type)
        state = structure.flatten(self.new(state_t, f"{comp.name} state"), state_t)
        self.ops.append(Call(comp, "prologue", leaves, state))
        self.ops.append(Loop(comp, dataset, leaves, state))
        self.ops.append(Call(comp, "epilogue", leaves + state, out_slots))
        return out


def _leaf_types(t: types.Type, label: str) -> list[types.TensorType]:
    for leaf in types.tensor_leaves(t):
        if not isinstance(leaf, types.TensorType) or isinstance(leaf, types.SparseTensorType):
            raise Error(f"Expected dense tensors in {label}, found {leaf}; browsers hold dense "
                        "tensors only.")
        if np.dtype(leaf.dtype).name not in DTYPES:
            raise Error(f"Expected tensors of {', '.join(DTYPES)} in {label}, found {leaf}; "
                        "browsers hold only these.")
    return structure.leaf_types(t)


def local_task(round_plan: plan_lib.RoundPlan) -> ir.Lambda:
    """The one-client IR the plan's task maps over the clients."""
    for node in ir.walk(round_plan.task.to_ir()):
        if (
            isinstance(node, ir.Call) and isinstance(node.function, ir.Intrinsic)
            and node.function.uri == intrinsic_defs.FEDERATED_MAP.uri
            and isinstance(node.argument, ir.Struct)
        ):
            fn = node.argument.elements[0][1]
            if isinstance(fn, ir.Lambda):
                return fn
    raise Error("Expected a round plan whose task maps a local task over the clients, found "
                "none; build plans with fedlang.deploy.")


# ----------------------------------------------------------------------------
# Programs: fused calls and loop steps


@dataclasses.dataclass
class Program:
    """A flat program over slots, and how to export and check it."""

    name: str
    fn: Callable[..., list[Any]]
    avals: list[jax.ShapeDtypeStruct]
    input_names: list[str]
    output_names: list[str]
    output_labels: list[str]
    onnx: bytes = b""


def _fused(calls: list[Call], inputs: list[int], outputs: list[int]) -> Callable[..., list[Any]]:
    def fn(*xs: Any) -> list[Any]:
        env = dict(zip(inputs, xs))
        for c in calls:
            env.update(zip(c.outputs, c.comp.part(c.part)(*[env[s] for s in c.inputs])))
        return [env[s] for s in outputs]

    return fn


def _stepper(comp: Any, args: list[int], inputs: list[int], n_state: int) -> Callable[..., list[Any]]:
    positions = [inputs.index(s) for s in args]
    step = comp.part("step")

    def fn(*xs: Any) -> list[Any]:
        unique, rest = xs[: len(inputs)], xs[len(inputs) :]
        state = list(rest[:n_state])
        return list(step(*[unique[p] for p in positions], *state, *rest[n_state:]))

    return fn


class Plan:
    """The programs and steps of a compiled task."""

    def __init__(self, compiler: Compiler, final: list[int]):
        self.compiler = compiler
        self.programs: list[Program] = []
        self.steps: list[dict[str, Any]] = []
        ops = compiler.ops
        later: list[set[int]] = [set() for _ in range(len(ops) + 1)]
        later[len(ops)] = set(final)
        for i in range(len(ops) - 1, -1, -1):
            op = ops[i]
            reads = set(op.inputs) if isinstance(op, Call) else set(op.args) | set(op.state)
            later[i] = later[i + 1] | reads
        group: list[Call] = []
        for i, item in enumerate([*ops, None]):
            if isinstance(item, Call):
                group.append(item)
                continue
            if group:  # the calls just before op i: later[i] is what is read after them
                self._add_fused(group, later[i])
                group = []
            if isinstance(item, Loop):
                self._add_loop(item)

    def _aval(self, slot: int, symbols: dict[str, Any]) -> jax.ShapeDtypeStruct:
        t = self.compiler.slots[slot][0]
        return jax.ShapeDtypeStruct(
            tuple(d if d is not None else symbols["a"] for d in t.shape), t.dtype
        )

    def _symbols(self, leaf_types: Sequence[types.TensorType]) -> dict[str, Any]:
        if all(t.is_fully_defined for t in leaf_types):
            return {}
        return {"a": jax.export.symbolic_shape("a")[0]}

    def _add_fused(self, calls: list[Call], needed_later: set[int]) -> None:
        produced: list[int] = [s for c in calls for s in c.outputs]
        inputs: list[int] = []
        for c in calls:
            for s in c.inputs:
                if s not in produced and s not in inputs:
                    inputs.append(s)
        outputs = [s for s in dict.fromkeys(produced) if s in needed_later]
        slots = self.compiler.slots
        symbols = self._symbols([slots[s][0] for s in inputs])
        name = f"p{len(self.programs)}"
        self.programs.append(Program(
            name, _fused(calls, inputs, outputs), [self._aval(s, symbols) for s in inputs],
            [f"s{s}" for s in inputs], [f"o{s}" for s in outputs],
            [slots[s][1] for s in outputs],
        ))
        self.steps.append({
            "kind": "run", "program": name,
            "inputs": {f"s{s}": s for s in inputs}, "outputs": {f"o{s}": s for s in outputs},
        })

    def _add_loop(self, loop: Loop) -> None:
        comp, slots = loop.comp, self.compiler.slots
        args = list(dict.fromkeys(loop.args))
        avals = jax_backend.program_avals(comp)["step"]
        n_args = len(loop.args)
        arg_avals = [avals[loop.args.index(s)] for s in args]
        element = loop.dataset.element
        name = f"p{len(self.programs)}"
        batch_names = [f"x{i}" for i in range(len(structure.leaf_types(element)))]
        self.programs.append(Program(
            name, _stepper(comp, loop.args, args, len(loop.state)),
            arg_avals + avals[n_args:],
            [f"s{s}" for s in args] + [f"s{s}" for s in loop.state] + batch_names + ["mask"],
            [f"o{s}" for s in loop.state], [slots[s][1] for s in loop.state],
        ))
        self.steps.append({
            "kind": "loop", "program": name, "dataset": loop.dataset.name,
            "inputs": {f"s{s}": s for s in args + loop.state},
            "outputs": {f"o{s}": s for s in loop.state},
            "batch": dict(zip(batch_names, _paths(element))), "mask": "mask",
        })


def _paths(t: types.Type, prefix: tuple[Any, ...] = ()) -> list[list[Any]]:
    """The path of each tensor of a value of type `t`: field names, or indices."""
    if isinstance(t, types.StructType):
        return [
            p for i, (n, et) in enumerate(t.elements)
            for p in _paths(et, (*prefix, n if n is not None else i))
        ]
    return [list(prefix)]


# ----------------------------------------------------------------------------
# The report


def _header(t: types.Type) -> dict[str, Any]:
    """The JSON header of a report of type `t` in the binary value format (the tensor
    shapes in it are those of a fully known type; the page fills in unknown ones)."""
    zeros = structure.unflatten(
        [np.zeros([d or 0 for d in lt.shape], lt.dtype) for lt in structure.leaf_types(t)], t
    )
    data = serialization.serialize_value(structure.to_python(zeros, t), t)
    (length,) = np.frombuffer(data[7:11], "<u4")
    return cast(dict[str, Any], json.loads(data[11 : 11 + int(length)].decode()))


def report_recipe(compiler: Compiler, round_plan: plan_lib.RoundPlan,
                  outputs: Sequence[Any]) -> tuple[list[dict[str, Any]], list[int]]:
    """Per tensor of the report, where its values come from (see the module docstring),
    and the slots it reads."""
    if round_plan.secure:
        raise Error("Expected a round without secure aggregation, found "
                    f"{[round_plan.aggregations[i].uri for i in round_plan.secure]}; browser "
                    "clients do not run SecAgg+ yet.")
    leaves: list[dict[str, Any]] = []
    for i, (agg, x) in enumerate(zip(round_plan.aggregations, outputs)):
        kind = KINDS.get(agg.uri)
        if kind is None:
            raise Error(f"Expected aggregations browsers pre-aggregate ({sorted(set(KINDS.values()))}), "
                        f"found {agg.uri} (aggregation {i}).")
        client_t = agg.client_type
        if kind == "weighted_mean":
            value_t = cast(types.StructType, client_t).types[0]
            value, weight = x
            (w,) = structure.flatten(weight, cast(types.StructType, client_t).types[1])
            if compiler.slots[w][0].dtype != np.float32 or any(
                lt.dtype != np.float32 for lt in structure.leaf_types(value_t)
            ):
                raise Error(f"Expected a float32 weighted mean, found {client_t} (aggregation {i}).")
            leaves += [{"slot": s, "times": w} for s in structure.flatten(value, value_t)]
            leaves.append({"slot": w})
            continue
        if kind == "aggregate":
            zero_value, accumulate_fn = agg.server_args[:2]
            value_t = agg.server_arg_types()[0]
            zero = compiler.const(zero_value, value_t, f"aggregation {i}'s zero")
            x = compiler.apply(compiler.eval(accumulate_fn.to_ir(), {}), (zero, x), value_t)
            client_t = value_t
        leaves += [{"slot": s} for s in structure.flatten(x, client_t)]
        if kind in ("mean", "aggregate"):
            leaves.append({"value": 1})  # count
        elif kind == "extremum":
            leaves.append({"value": True})  # seen
    reads = sorted({r[k] for r in leaves for k in ("slot", "times") if k in r})
    return leaves, reads


# ----------------------------------------------------------------------------
# The whole task


@dataclasses.dataclass
class BrowserTask:
    """A compiled task: its programs (exported once `export` ran) and its description."""

    compiler: Compiler
    plan: Plan
    broadcast: list[int]
    data: dict[str, types.Type]
    report: dict[str, Any]
    state: dict[str, Any] | None = None

    def export(self) -> None:
        for p in self.plan.programs:
            onnx_export.check_program(p.fn, p.avals, describe(p))
        for p in self.plan.programs:
            p.onnx = onnx_export.export(p.fn, p.avals, p.input_names, p.output_names, describe(p))

    def description(self) -> dict[str, Any]:
        """The JSON description (the plan's `browser` section)."""
        if any(not p.onnx for p in self.plan.programs):
            self.export()
        slots = self.compiler.slots
        return {
            "format": FORMAT,
            "version": VERSION,
            "jax2onnx": onnx_export.JAX2ONNX_VERSION,
            "opset": onnx_export.OPSET,
            "slots": [{"dtype": np.dtype(t.dtype).name, "shape": list(t.shape), "label": label}
                      for t, label in slots],
            "broadcast": self.broadcast,
            "consts": {str(s): _tensor_json(v) for s, v in self.compiler.consts.items()},
            "data": {name: _data_json(t) for name, t in self.data.items()},
            "programs": {p.name: base64.b64encode(p.onnx).decode() for p in self.plan.programs},
            "run": self.plan.steps,
            "report": self.report,
            **({"state": self.state} if self.state is not None else {}),
        }


def describe(p: Program) -> str:
    """A program for messages: its name and what it computes."""
    return f"program {p.name} ({', '.join(dict.fromkeys(p.output_labels)) or 'no outputs'})"


def _tensor_json(value: np.ndarray) -> dict[str, Any]:
    arr = np.ascontiguousarray(value)
    return {"dtype": arr.dtype.name, "shape": list(arr.shape),
            "data": base64.b64encode(arr.astype(arr.dtype.newbyteorder("<")).tobytes()).decode()}


def _data_json(element: types.Type) -> dict[str, Any]:
    return {"leaves": [
        {"path": path, "dtype": np.dtype(lt.dtype).name, "shape": list(lt.shape)}
        for path, lt in zip(_paths(element), _leaf_types(element, "the client data"))
    ], "mask": local.mask_type(element).shape[0]}


def compile_task(round_plan: plan_lib.RoundPlan) -> BrowserTask:
    """The browser task of a plan, before export.

    Raises:
      BrowserExportError: naming what browsers cannot run.
    """
    fn = local_task(round_plan)
    arg_t = cast(types.StructType, fn.parameter_type)
    data_t, broadcast_t = arg_t.types[:2]
    compiler = Compiler()
    datasets = []
    for name, t in cast(types.StructType, data_t).elements:
        if not isinstance(t, types.SequenceType):
            raise Error(f"Expected client data {name!r} to be a dataset, found {t}.")
        _leaf_types(t.element, f"client data {name!r}")
        datasets.append(Dataset(cast(str, name), t.element))
    broadcast = compiler.new(broadcast_t, "broadcast")
    arg: tuple[Any, ...] = (tuple(datasets), broadcast)
    sp = round_plan.state
    if sp is not None:
        arg = (*arg, compiler.new(sp.state_type, f"client state {sp.name!r}"))
    result = compiler.eval(fn.result, {cast(str, fn.parameter_name): arg})
    state: dict[str, Any] | None = None
    outputs: list[int] = []
    if sp is not None:
        outputs = structure.flatten(result[-1], sp.state_type) if sp.writes else []
        result = result[:-1] if sp.writes else result
        initial = serialization.serialize_value(sp.initialize(), sp.state_type)
        state = {"name": sp.name, "header": _header(sp.state_type),
                 "inputs": structure.flatten(arg[2], sp.state_type), "outputs": outputs,
                 "initial": base64.b64encode(initial).decode()}
    leaves, reads = report_recipe(compiler, round_plan, result)
    plan = Plan(compiler, reads + outputs)
    report = {"header": _header(round_plan.report_type), "leaves": leaves}
    return BrowserTask(compiler, plan, structure.flatten(broadcast, broadcast_t),
                       {d.name: d.element for d in datasets}, report, state)

