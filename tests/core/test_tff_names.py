"""TFF's spellings get fedlang's in the AttributeError; other names keep Python's message."""

import pytest

from fedlang.core import tff_names


class _Thing:
    def __getattr__(self, name):
        raise tff_names.missing(self, name, {"tff_method": "fedlang_method(x)"})


def test_a_tff_spelling_names_fedlangs_and_others_read_as_pythons():
    thing = _Thing()
    with pytest.raises(AttributeError) as raised:
        thing.tff_method  # noqa: B018
    assert str(raised.value) == (
        "_Thing has no attribute 'tff_method' (TFF's spelling); fedlang's is fedlang_method(x).")
    assert raised.value.name == "tff_method" and raised.value.obj is thing
    with pytest.raises(AttributeError, match=r"^'_Thing' object has no attribute 'other'$"):
        thing.other  # noqa: B018
    assert not hasattr(thing, "other")
