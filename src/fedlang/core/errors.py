"""Errors for bytes from outside: every malformed input raises one of these."""


class SerializationError(ValueError):
    """Bytes that are not a valid fedlang serialization (or cannot be written as one)."""


class SignatureError(SerializationError):
    """Signed bytes that do not verify against the pinned key (or are not signed)."""
