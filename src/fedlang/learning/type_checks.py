"""Type checks between the parts of a learning process, with a diff of large types.

When one part's output does not fit the next part's input, the error names both parts
and, for large types such as model weights, only the fields that differ (TFF prints a
diff of the two types) instead of two long lines.
"""

from __future__ import annotations

from fedlang.core import types

MAX_DIFFS = 6


def type_diff(expected: types.Type, found: types.Type, path: str = "") -> list[str]:
    """The fields where `found` cannot be assigned to `expected`, as 'path: expected vs found'.

    Args:
      expected: the type a part accepts.
      found: the type it is given.
      path: the prefix of the reported paths.

    Returns:
      One line per differing field (empty when `expected` accepts `found`).
    """
    where = path or "(the whole value)"
    if expected.is_assignable_from(found):
        return []
    if isinstance(expected, types.FederatedType) and isinstance(found, types.FederatedType):
        if expected.placement is not found.placement or (
                not found.all_equal and expected.all_equal):
            return [f"{where}: expected {expected}, found {found}"]
        return type_diff(expected.member, found.member, path)
    if isinstance(expected, types.StructType) and isinstance(found, types.StructType):
        if expected.names != found.names and (len(expected) != len(found) or any(
                a is not None and b is not None for a, b in zip(expected.names, found.names))):
            missing = [n for n in expected.names if n not in found.names]
            extra = [n for n in found.names if n not in expected.names]
            if missing or extra or len(expected) != len(found):
                parts = []
                if missing:
                    parts.append(f"missing fields {missing}")
                if extra:
                    parts.append(f"unexpected fields {extra}")
                if not parts:
                    parts.append(f"{len(expected)} fields expected, {len(found)} found")
                return [f"{where}: {'; '.join(parts)}"]
        out = []
        for i, (name, e) in enumerate(expected.elements):
            f = found[name] if name is not None and name in found.names else found[i]
            out += type_diff(e, f, f"{path}/{name if name is not None else i}".lstrip("/"))
        return out or [f"{where}: expected {expected}, found {found}"]
    return [f"{where}: expected {expected}, found {found}"]


def check_fits(expected: types.Type, found: types.Type, what: str, fix: str = "") -> None:
    """Raises a `TypeError` naming `what` and the differing fields unless `expected`
    accepts `found`.

    Args:
      expected: the type the consumer accepts.
      found: the type the producer gives.
      what: e.g. "client_work's weights parameter ... the distributor's result".
      fix: a sentence saying what to do.

    Raises:
      TypeError: when the types do not fit.
    """
    diffs = type_diff(expected, found)
    if not diffs:
        return
    shown = diffs[:MAX_DIFFS]
    more = f"; and {len(diffs) - MAX_DIFFS} more" if len(diffs) > MAX_DIFFS else ""
    raise TypeError(
        f"Expected {what}; they differ at {'; '.join(shown)}{more}." + (f" {fix}" if fix else "")
    )
