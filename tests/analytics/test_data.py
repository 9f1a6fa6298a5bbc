import numpy as np

from fedlang.analytics import data
from fedlang.backends.jax import strings


def test_encode_clients_batches_and_counts_truncation():
    enc = data.encode_clients([["a", "bb"], [], ["much too long", "ok"]], max_len=4, batch_size=1)
    assert [len(d) for d in enc.datasets] == [2, 0, 2]
    assert enc.truncated == 1
    first = enc.datasets[2][0]
    assert strings.decode(first["bytes"], first["length"]).tolist() == ["much"]


def test_number_batches():
    assert data.number_batches([]) == []
    batches = data.number_batches(np.arange(5), np.float32, batch_size=2)
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    assert str(data.number_type(np.float32, [3])) == "sequence<float32[?,3]>"
    assert str(data.string_type(8)) == "sequence<<bytes=uint8[?,8],length=int32[?]>>"
