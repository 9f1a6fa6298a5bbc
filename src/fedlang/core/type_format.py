"""Long types, readable: TFF's multi-line form, types in error messages, what differs.

`str(t)` prints a type on one line, as TFF does; a learning process's state is over a
thousand characters of it. `t.formatted_representation()` (written in `types.py`) is
TFF's multi-line form: a struct opens on one line, holds one field per line indented by
two spaces, and closes on a line of its own::

    (<
      state=<
        round_num=int32
      >@SERVER,
      client_data={sequence<float32[?]>}@CLIENTS
    > -> int32@SERVER)

(TFF writes a sequence `float32*`, fedlang `sequence<float32>`; see docs/from-tff.md.)
Error messages print a type with `for_message`: on one line when it is short, else in
the multi-line form; and `difference` names the first place two types part.
"""

from __future__ import annotations

import textwrap

from fedlang.core import types

#: Types printed longer than this go on lines of their own in error messages.
SHORT = 100


def for_message(t: types.Type) -> str:
    """`t` for an error message: `str(t)` when short, else its multi-line form on lines of
    its own, indented, so that the sentence around it stays readable."""
    text = str(t)
    if len(text) <= SHORT:
        return text
    return "\n" + textwrap.indent(t.formatted_representation(), "    ")


def expected_found(expected: types.Type, found: types.Type) -> str:
    """`"EXPECTED, found FOUND"` for "... of type EXPECTED, found FOUND": each type as
    `for_message` prints it, and where they part when that is inside them.

    Example:
      >>> import numpy as np
      >>> expected_found(types.to_type({'a': np.int32}), types.to_type({'a': np.float32}))
      '<a=int32>, found <a=float32> (at .a: expected int32, found float32)'
    """
    text = f"{for_message(expected)}, found {for_message(found)}"
    where = difference(expected, found)
    if where is None or where.startswith("at the top"):
        return text
    return f"{text} ({where})"


def difference(expected: types.Type, found: types.Type, path: str = "") -> str | None:
    """Where `found` first fails to fit `expected`: `"at .state.x: expected float32[4],
    found float32[3]"`, or None when `expected.is_assignable_from(found)`.

    Example:
      >>> import numpy as np
      >>> difference(types.to_type({'a': np.int32, 'b': (np.float32, [4])}),
      ...            types.to_type({'a': np.int32, 'b': (np.float32, [3])}))
      'at .b: expected float32[4], found float32[3]'
    """
    if expected.is_assignable_from(found):
        return None
    where = path or "the top"
    if isinstance(expected, types.StructType) and isinstance(found, types.StructType):
        if len(expected) != len(found):
            return (f"at {where}: expected {len(expected)} fields {list(expected.names)}, "
                    f"found {len(found)} {list(found.names)}")
        for i, ((en, et), (fn, ft)) in enumerate(zip(expected.elements, found.elements)):
            if en is not None and fn is not None and en != fn:
                return f"at {path}[{i}]: expected a field named {en!r}, found {fn!r}"
            inner = difference(et, ft, f"{path}.{en}" if en is not None else f"{path}[{i}]")
            if inner is not None:
                return inner
    if (
        isinstance(expected, types.FederatedType)
        and isinstance(found, types.FederatedType)
        and expected.placement is found.placement
        and (found.all_equal or not expected.all_equal)
    ):
        return difference(expected.member, found.member, path)
    if isinstance(expected, types.SequenceType) and isinstance(found, types.SequenceType):
        return difference(expected.element, found.element, f"{path}<element>")
    return f"at {where}: expected {for_message(expected)}, found {for_message(found)}"
