import threading

import pytest

from fedlang.simulation import _prefetch


def test_prefetch_passes_items_and_errors():
    assert list(_prefetch.prefetch(lambda: iter(range(5)), 2)) == [0, 1, 2, 3, 4]

    def bad():
        yield 1
        raise KeyError("x")

    with pytest.raises(KeyError):
        list(_prefetch.prefetch(bad, 1))


def test_prefetch_starts_no_thread_until_first_next():
    baseline = threading.active_count()
    it = _prefetch.prefetch(lambda: iter(range(5)), 2)
    assert threading.active_count() == baseline
    assert next(it) == 0
    it.close()
    assert threading.active_count() == baseline
