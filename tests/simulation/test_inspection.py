import doctest

import numpy as np
import pytest

from fedlang.simulation import client_data, inspection


def test_histogram_covers_every_client():
    cd = client_data.ClientData.from_tensor_slices(
        {str(i): {"x": np.zeros(n, np.float32)} for i, n in enumerate([1, 2, 2, 9, 30])})
    summary = inspection.summarize(cd)
    hist = summary.histogram(bins=3)
    assert sum(c for _, _, c in hist) == 5 and hist[0][0] == 1 and hist[-1][1] == 30


def test_detect_format(tmp_path):
    (tmp_path / "a.csv").write_text("u,x\n")
    (tmp_path / "clients" / "c1").mkdir(parents=True)
    assert inspection.detect_format(tmp_path / "a.csv") == "csv"
    assert inspection.detect_format(tmp_path / "clients") == "directory"
    with pytest.raises(ValueError, match="Expected a format in"):
        inspection.open_source(tmp_path / "a.csv", "parquet")
    with pytest.raises(FileNotFoundError):
        inspection.detect_format(tmp_path / "missing")


def test_docstring_example():
    result = doctest.testmod(inspection)
    assert result.attempted > 0 and result.failed == 0
