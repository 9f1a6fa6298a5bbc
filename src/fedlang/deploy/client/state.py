"""A device's client states: one file per population and state name, replaced atomically.

A round's task with client state (`plans.round.StatePlan`) reads the device's state
before it runs and gives the new state after; the state never leaves the device. The
Python client keeps each state in its state directory as
`<directory>/<population>/<name>.state`: the project's binary value format (a typed
header, then the tensors), so a file written for another state type is refused on
read, never misread.

Writes are atomic: the new state goes to a temporary file in the same directory,
which is flushed and fsynced, then `os.replace`d over the old one, and the directory
is fsynced. A reader (or a client restarted after a crash at any point) sees either
the old state or the new one, whole. `Client` commits a new state only once the
server has acknowledged the report it was computed with (see `fedlang.deploy.client`).

Example:
  >>> import tempfile, numpy as np, fedlang as fl
  >>> states = DeviceStates(tempfile.mkdtemp())
  >>> t = fl.TensorType(np.float32, [2])
  >>> states.read("pop", "c", t) is None  # never written: the plan's initial state
  True
  >>> states.commit("pop", "c", t, np.array([1, 2], np.float32))
  >>> states.read("pop", "c", t)
  array([1., 2.], dtype=float32)
"""

from __future__ import annotations

import os
import pathlib
import tempfile
from typing import Any

from fedlang.core import serialization, types


class StateFileError(ValueError):
    """A stored client state cannot be used for the task (another type, or corrupt)."""


class DeviceStates:
    """The client states of one device, kept under `directory` (made on first write)."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = pathlib.Path(directory)

    def path(self, population: str, name: str) -> pathlib.Path:
        """The file of state `name` of `population`."""
        for what, part in (("population", population), ("state name", name)):
            if not part or "/" in part or "\\" in part or part.startswith("."):
                raise ValueError(f"Expected a {what} usable as a file name, found {part!r}.")
        return self.directory / population / f"{name}.state"

    def read(self, population: str, name: str, state_type: types.Type) -> Any:
        """The stored state (a Python value of `state_type`), or None if there is none.

        Raises:
          StateFileError: if the file holds another type or is not a valid state.
        """
        path = self.path(population, name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return serialization.deserialize_value(data, expected_type=state_type)
        except serialization.SerializationError as e:
            raise StateFileError(
                f"The client state in {path} is not a state of type {state_type} ({e}). It "
                "was written for another computation: move it away (the client then starts "
                "from the plan's initial state) or use another state name."
            ) from e

    def commit(self, population: str, name: str, state_type: types.Type, value: Any) -> None:
        """Makes `value` the stored state, atomically and durably."""
        path = self.path(population, name)
        data = serialization.serialize_value(value, state_type)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
