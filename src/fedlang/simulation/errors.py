"""The errors of the data layer that more than one module raises."""

from __future__ import annotations


class UnknownClientError(KeyError, ValueError):
    """A client id that the `ClientData` does not have (a `KeyError` and `ValueError`)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StoreError(ValueError):
    """A store directory exists but is corrupt or not a fedlang store."""
