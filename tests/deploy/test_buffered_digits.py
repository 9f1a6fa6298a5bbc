"""End to end: a FedBuff session on 20 client processes with random delays trains
scikit-learn's digits to >= 0.85 held-out accuracy (examples/deploy_fedbuff.py)."""

import sys

import pytest

from .conftest import ROOT


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_twenty_slow_client_processes_train_digits_asynchronously(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    import deploy_fedbuff

    result = deploy_fedbuff.run(steps=60, num_clients=20, buffer_size=10, max_delay=1.0,
                                workdir=tmp_path, verbose=False, target=0.85, timeout=900)

    assert result["accuracy"][-1] >= 0.85, result["accuracy"]
    session = result["status"]["sessions"][0]
    process_status = result["process"].status(result["state"])
    steps = len(result["accuracy"])
    # every report the server accepted and applied is in the state once
    assert session["version"] == process_status["version"] == steps
    assert process_status["accepted"] >= 10 * steps
    assert sum(session["staleness_histogram"].values()) == session["accepted"]
    assert session["state"] == "closed"
