"""Runs examples/async_vs_sync.py small: three runs on the virtual clock and a plot."""

import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_vs_sync_compares_on_the_virtual_clock_and_plots(load_script, tmp_path):
    path = tmp_path / "accuracy_vs_time.png"
    rows = load_script("examples/async_vs_sync.py").main(
        [str(path), "--max-time", "15", "--clients", "30", "--cohort", "6",
         "--buffer-size", "3", "--target", "0.5"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(rows) == 3
    sync, over, buff = rows.values()
    # in the same virtual time, FedBuff and over-selection take more server steps than
    # rounds that wait for their slowest client, and every run learns something
    assert buff["steps"] > sync["steps"] and over["steps"] > sync["steps"]
    assert over["discarded"] > 0
    assert all(r["accuracy"] > 0.2 for r in rows.values())  # chance is 0.1
