"""Checking exported StableHLO programs before this process trusts them.

A serialized computation carries native programs. Their CRC detects accidents, not
attacks: one changed byte can make jaxlib abort, crash or hang when it parses or runs
the program, a swapped program can return values of another type than the computation
declares, and a program can call native code by name (`custom_call`). So a loaded
program must

* take and return exactly the flat types its computation declares
  (`check_types`), and
* call only custom-call targets on `ALLOWED_CUSTOM_CALLS` (`check_custom_calls`),

and bytes that are not trusted (signed by a pinned key, or vouched for by the caller)
are first loaded, compiled and run once on zeros by a separate checking process
(`Checker`). Only if that process survives and agrees does this process parse them.
The checker is started on first use, reused across calls, and restarted if a program
kills it.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedlang.core import errors, local, structure, types

# JAX's own list of custom calls guaranteed stable for export (linear algebra on CPU and
# GPU, sharding annotations, shape assertions, RNG), minus the ones that carry
# arbitrary user kernels (Pallas/Mosaic, TPU custom calls) or call into TensorFlow.
ALLOWED_CUSTOM_CALLS = frozenset(
    {
        "AllocateBuffer",
        "ApproxTopK",
        "Eigh",
        "LuDecomposition",
        "ProductOfElementaryHouseholderReflectors",
        "Qr",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "Sharding",
        "annotate_device_placement",
        "shape_assertion",
        "stablehlo.dynamic_approx_top_k",
        "stablehlo.dynamic_reduce_window",
        "stablehlo.dynamic_rng_bit_generator",
        "stablehlo.dynamic_top_k",
        "cu_lu_pivots_to_permutation",
        "cu_threefry2x32_ffi",
        "hip_lu_pivots_to_permutation",
        "hip_threefry2x32_ffi",
        "cusparse_gtsv2_ffi",
    }
    | {
        f"{lib}_{op}_ffi"
        for lib in ("cusolver", "hipsolver")
        for op in ("geqrf", "gesvd", "gesvdj", "gesdd", "getrf", "orgqr", "potrf", "syevd", "sytrd")
    }
    | {
        f"lapack_{t}{op}_ffi"
        for t in "sdcz"
        for op in ("gees", "geev", "gehrd", "geqrf", "gesdd", "getrf", "gtsv", "potrf", "trsm")
    }
    | {f"lapack_{t}{op}_ffi" for t in "sd" for op in ("orgqr", "syevd", "sytrd")}
    | {f"lapack_{t}{op}_ffi" for t in "cz" for op in ("ungqr", "heevd", "hetrd")}
)

_CUSTOM_CALL = re.compile(r'custom_call\s*@([\w.$-]+)|call_target_name\s*=\s*"([^"]*)"')

Spec = list[tuple[str, list[int | None]]]  # (dtype name, dims; None = unknown) per leaf


def leaf_specs(leaf_types: Sequence[types.TensorType]) -> Spec:
    """The expected (dtype, dims) of flat leaves of the given tensor types, with dtypes as
    JAX holds them (64-bit types are 32-bit unless `jax_enable_x64` is on)."""
    import jax

    return [
        (np.dtype(jax.dtypes.canonicalize_dtype(lt.dtype)).name, list(lt.shape))
        for lt in leaf_types
    ]


def expected_programs(
    param_types: Sequence[types.Type],
    result_type: types.Type,
    seq_index: int | None,
    state_type: types.Type | None,
    uses_reduce: bool,
) -> dict[str, tuple[Spec, Spec]]:
    """(argument specs, result specs) of each program a computation of these types has."""
    args = [
        lt for i, t in enumerate(param_types) if i != seq_index for lt in structure.leaf_types(t)
    ]
    result = structure.leaf_types(result_type)
    if seq_index is None:
        return {"fn": (leaf_specs(args), leaf_specs(result))}
    if not uses_reduce:
        return {"epilogue": (leaf_specs(args), leaf_specs(result))}
    assert state_type is not None
    element_type = _checked_sequence(param_types[seq_index]).element
    element = [*structure.leaf_types(element_type), local.mask_type(element_type)]
    state = structure.leaf_types(state_type)
    return {
        "prologue": (leaf_specs(args), leaf_specs(state)),
        "step": (leaf_specs(args + state + element), leaf_specs(state)),
        "epilogue": (leaf_specs(args + state), leaf_specs(result)),
    }


def _checked_sequence(t: types.Type) -> types.SequenceType:
    if not isinstance(t, types.SequenceType):
        raise errors.SerializationError(f"Expected a sequence type for the dataset, found {t}.")
    return t


def _aval_spec(aval: Any) -> tuple[str, list[Any]]:
    return np.dtype(aval.dtype).name, [d if isinstance(d, int) else str(d) for d in aval.shape]


def _matches(found: tuple[str, list[Any]], expected: tuple[str, list[int | None]]) -> bool:
    (fd, fs), (ed, es) = found, expected
    if fd != ed or len(fs) != len(es):
        return False
    # A known dimension must be that size; an unknown one must be symbolic in the program.
    return all((e is None and not isinstance(f, int)) or f == e for f, e in zip(fs, es))


def _describe(specs: Sequence[tuple[str, list[Any]]]) -> str:
    return (
        "["
        + ", ".join(f"{d}[{','.join('?' if x is None else str(x) for x in s)}]" for d, s in specs)
        + "]"
    )


def check_types(name: str, part: str, exported: Any, expected: tuple[Spec, Spec]) -> None:
    """Refuses a program whose flat argument or result types differ from the declared ones."""
    for what, found, want in (
        ("arguments", exported.in_avals, expected[0]),
        ("results", exported.out_avals, expected[1]),
    ):
        specs = [_aval_spec(a) for a in found]
        if len(specs) != len(want) or not all(_matches(f, w) for f, w in zip(specs, want)):
            raise errors.SerializationError(
                f"Expected the {part} program of {name} to have {what} {_describe(want)} as "
                f"its type signature declares, found {_describe(specs)}. The program does not "
                "belong to this computation (damaged or crafted bytes)."
            )
    if exported.nr_devices != 1:
        raise errors.SerializationError(
            f"Expected the {part} program of {name} to run on one device, found {exported.nr_devices}."
        )


def custom_call_targets(mlir_text: str) -> set[str]:
    """The custom-call targets a StableHLO module calls."""
    return {a or b for a, b in _CUSTOM_CALL.findall(mlir_text)}


def check_custom_calls(name: str, part: str, exported: Any) -> None:
    """Refuses a program that calls a custom-call target outside the allow-list."""
    refused = sorted(custom_call_targets(exported.mlir_module()) - ALLOWED_CUSTOM_CALLS)
    if refused:
        raise errors.SerializationError(
            f"The {part} program of {name} calls native code that is not allowed: "
            f"{', '.join(refused)}. Programs may only call JAX's stable targets "
            "(fedlang.backends.jax.verify.ALLOWED_CUSTOM_CALLS)."
        )


def check_loaded(name: str, part: str, exported: Any, expected: tuple[Spec, Spec]) -> None:
    """Both checks, on a program already parsed in this process."""
    check_types(name, part, exported, expected)
    check_custom_calls(name, part, exported)


# ----------------------------------------------------------------------------
# The checking process


def _zeros_for(aval: Any) -> np.ndarray:
    return np.zeros([d if isinstance(d, int) else 2 for d in aval.shape], aval.dtype)


def check_in_this_process(name: str, part: str, blob: bytes, expected: tuple[Spec, Spec]) -> None:
    """Parses, checks, compiles and runs once on zeros: what the checking process does."""
    import jax

    exported = jax.export.deserialize(bytearray(blob))
    check_loaded(name, part, exported, expected)
    if jax.default_backend() in exported.platforms:
        outs = jax.jit(exported.call)(*[_zeros_for(a) for a in exported.in_avals])
        jax.block_until_ready(outs)


def _child_main() -> None:  # pragma: no cover - runs in the checking process
    """Serves check requests on stdin/stdout until stdin closes."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = inp.read(4)
        if len(head) < 4:
            return
        request = json.loads(inp.read(struct.unpack("<I", head)[0]))
        blobs = [inp.read(n) for n in request["sizes"]]
        try:
            for prog, blob in zip(request["programs"], blobs):
                expected = tuple([(d, s) for d, s in spec] for spec in prog["expected"])
                check_in_this_process(request["name"], prog["part"], blob, expected)  # type: ignore[arg-type]
            reply: dict[str, Any] = {"ok": True}
        except Exception as e:  # every failure is reported to the parent, which raises
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        data = json.dumps(reply).encode()
        out.write(struct.pack("<I", len(data)) + data)
        out.flush()


class Checker:
    """A reusable checking process (see the module docstring).

    Args:
      timeout: seconds a check may take (starting the process included) before the
        bytes are refused; `FEDLANG_VERIFY_TIMEOUT` overrides the default of 120.
    """

    def __init__(self, timeout: float | None = None):
        self.timeout = timeout or float(os.environ.get("FEDLANG_VERIFY_TIMEOUT", "120"))
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._verdicts: set[bytes] = set()
        # The checking process: a Python running `_child_main` (tests replace it).
        self.command = [
            sys.executable,
            "-c",
            "from fedlang.backends.jax import verify; verify._child_main()",
        ]

    def _start(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is not None:
            self._stop()  # it died (a hostile program, or killed): close its pipes
        if self._proc is None:
            package_root = os.path.dirname(os.path.dirname(os.path.abspath(_fedlang_file())))
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                [package_root, *filter(None, [env.get("PYTHONPATH")])]
            )
            env.setdefault("JAX_PLATFORMS", "cpu")  # a check needs no accelerator
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
            )
        return self._proc

    def close(self) -> None:
        """Stops the checking process."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def check(
        self, name: str, programs: dict[str, bytes], expected: dict[str, tuple[Spec, Spec]]
    ) -> None:
        """Checks `programs` (part -> bytes) in the checking process.

        Raises:
          SerializationError: if a program fails a check, or crashes or hangs the
            checking process.
        """
        key = hashlib.sha256(
            json.dumps([name, sorted(expected.items())], default=str).encode()
            + b"".join(hashlib.sha256(programs[p]).digest() for p in sorted(programs))
        ).digest()
        if key in self._verdicts:
            return
        parts = sorted(programs)
        request = json.dumps(
            {
                "name": name,
                "programs": [{"part": p, "expected": list(expected[p])} for p in parts],
                "sizes": [len(programs[p]) for p in parts],
            }
        ).encode()
        with self._lock:
            reply = self._ask(
                name, struct.pack("<I", len(request)) + request, [programs[p] for p in parts]
            )
        if not reply.get("ok"):
            raise errors.SerializationError(
                f"Expected the programs of {name} to load and run as their types declare; the "
                f"checking process refused them: {reply.get('error')}"
            )
        self._verdicts.add(key)

    def _ask(self, name: str, head: bytes, blobs: list[bytes]) -> dict[str, Any]:
        proc = self._start()
        result: dict[str, Any] = {}

        def exchange() -> None:
            try:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(head)
                for b in blobs:
                    proc.stdin.write(b)
                proc.stdin.flush()
                size = proc.stdout.read(4)
                if len(size) == 4:
                    result["reply"] = json.loads(proc.stdout.read(struct.unpack("<I", size)[0]))
            except (OSError, ValueError) as e:
                result["error"] = e

        worker = threading.Thread(target=exchange, daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            self._stop()
            raise errors.SerializationError(
                f"Checking the programs of {name} took more than {self.timeout:.0f} s; refusing "
                "them (damaged or crafted bytes can make a program hang). Set "
                "FEDLANG_VERIFY_TIMEOUT for very large programs."
            )
        if "reply" not in result:
            code = proc.poll()
            self._stop()
            how = (
                f"exit status {code}"
                if code is not None and code >= 0
                else f"signal {-(code or 0)}"
            )
            raise errors.SerializationError(
                f"Checking the programs of {name} crashed the checking process ({how}); the "
                "bytes are damaged or crafted. This process is unaffected."
            )
        return result["reply"]


def _fedlang_file() -> str:
    import fedlang

    return fedlang.__file__ or ""


_checker: Checker | None = None
_checker_lock = threading.Lock()


def checker() -> Checker:
    """The process-wide checker (started on first use, stopped at exit)."""
    global _checker
    with _checker_lock:
        if _checker is None:
            _checker = Checker()
            atexit.register(_checker.close)
        return _checker
