"""Embedded programs from untrusted bytes never crash, hang or lie (issue 10, finding 1).

Each test loads bytes in this process the way a user would; the checks must keep the
process alive (a crash would fail the whole test run, which is the point).
"""

import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang.backends.jax import verify
from fedlang.core import serialization, signing, wire


@fl.jax_computation(np.float32)
def frac(x):
    return x - jnp.floor(x)


@fl.federated_computation(fl.type_at_server(np.float32))
def frac_at_server(x):
    return fl.federated_map(frac, x)


def _with_program(comp, program: bytes) -> bytes:
    """`comp`'s bytes with its only embedded program replaced (CRC made valid again)."""
    header, blobs = wire.unpack(comp.to_bytes(), wire.KIND_COMPUTATION)
    (local,) = header["locals"]
    (index,) = local["meta"]["programs"].values()
    blobs[index] = program
    return wire.pack(wire.KIND_COMPUTATION, header, blobs)


def _program_of(comp) -> bytes:
    header, blobs = wire.unpack(comp.to_bytes(), wire.KIND_COMPUTATION)
    (local,) = header["locals"]
    (index,) = local["meta"]["programs"].values()
    return blobs[index]


def _exported(fn, *avals, disabled=()) -> bytes:
    return bytes(jax.export.export(jax.jit(fn), disabled_checks=list(disabled))(*avals).serialize())


F32 = jax.ShapeDtypeStruct((), np.float32)


def test_a_program_returning_another_shape_is_refused():
    swapped = _with_program(frac_at_server, _exported(lambda x: jnp.zeros((4, 5)) + x, F32))
    for trusted in (False, True):
        with pytest.raises(serialization.SerializationError, match=r"results \[float32\[\]\]"):
            fl.Computation.from_bytes(swapped, trusted=trusted)


def test_a_program_of_another_dtype_is_refused():
    swapped = _with_program(frac_at_server, _exported(lambda x: x.astype(jnp.int32), F32))
    with pytest.raises(serialization.SerializationError, match=r"found \[int32\[\]\]"):
        fl.Computation.from_bytes(swapped, trusted=True)
    other_arg = _with_program(
        frac_at_server, _exported(lambda x: x.astype(jnp.float32), jax.ShapeDtypeStruct((), np.int32))
    )
    with pytest.raises(serialization.SerializationError, match="arguments"):
        fl.Computation.from_bytes(other_arg, trusted=True)


def test_a_program_calling_native_code_by_name_is_refused():
    def with_callback(x):  # a custom call to the host-callback target, by name
        return jax.ffi.ffi_call("xla_ffi_python_cpu_callback", F32)(x)

    program = _exported(
        with_callback,
        F32,
        disabled=[jax.export.DisabledSafetyCheck.custom_call("xla_ffi_python_cpu_callback")],
    )
    assert "xla_ffi_python_cpu_callback" in verify.custom_call_targets(
        jax.export.deserialize(bytearray(program)).mlir_module()
    )
    hostile = _with_program(frac_at_server, program)
    for trusted in (False, True):
        with pytest.raises(serialization.SerializationError, match="xla_ffi_python_cpu_callback"):
            fl.Computation.from_bytes(hostile, trusted=trusted)


def test_damaged_programs_never_take_the_process_down():
    good = _program_of(frac_at_server)
    rng = random.Random(7)
    outcomes = []
    for _ in range(8):
        damaged = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        try:
            comp = fl.Computation.from_bytes(_with_program(frac_at_server, bytes(damaged)))
        except serialization.SerializationError:
            outcomes.append("refused")
            continue
        # Accepted: it passed every check, so it is a well-typed program (maybe a different
        # one: only a signature says who wrote it). It runs and returns the declared type.
        result = comp(np.float32(2.25))
        assert np.asarray(result).dtype == np.float32 and np.shape(result) == ()
        outcomes.append("accepted")
    assert len(outcomes) == 8
    assert float(frac_at_server(np.float32(2.25))) == 0.25  # this process still works


def _frac_check_args():
    programs = {"fn": _program_of(frac_at_server)}
    f32 = fl.to_type(np.float32)
    return programs, verify.expected_programs([f32], f32, None, None, False)


@pytest.mark.parametrize(
    ("child", "message"),
    [
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "crashed the checking process"),
        ("import time; time.sleep(30)", "took more than 2 s"),
    ],
)
def test_a_checker_that_crashes_or_hangs_refuses_the_bytes(child, message):
    checker = verify.Checker(timeout=2)
    checker.command = [sys.executable, "-c", child]
    try:
        with pytest.raises(serialization.SerializationError, match=message):
            checker.check("frac", *_frac_check_args())
    finally:
        checker.close()
    assert checker._proc is None


def test_the_checker_restarts_after_its_process_died():
    checker = verify.Checker(timeout=120)
    programs, expected = _frac_check_args()
    try:
        checker.check("frac", programs, expected)
        checker._proc.kill()  # as if a hostile program had killed it
        checker._proc.wait()
        checker._verdicts.clear()
        checker.check("frac", programs, expected)  # a fresh process answers
    finally:
        checker.close()


def test_signed_programs_load_without_a_checking_process():
    key = signing.generate_key()
    signed = signing.sign(frac_at_server.to_bytes(), key)
    back = fl.Computation.from_bytes(signed, public_key=key.public_key())
    assert float(back(np.float32(3.75))) == 0.75
    hostile = signing.sign(_with_program(frac_at_server, _exported(lambda x: jnp.zeros((4, 5)), F32)), key)
    with pytest.raises(serialization.SerializationError, match="results"):
        fl.Computation.from_bytes(hostile, public_key=key.public_key())
