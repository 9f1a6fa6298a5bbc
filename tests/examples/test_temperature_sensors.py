"""Runs examples/temperature_sensors.py and checks what it prints and returns."""

import numpy as np
import pytest


@pytest.fixture(scope="module")
def example(load_script):
    return load_script("examples/temperature_sensors.py")


def test_main_prints_types_and_results(example, capsys):
    # act
    result = example.main()

    # assert
    assert result["average_type"] == "({float32}@CLIENTS -> float32@SERVER)"
    assert result["fraction_type"] == (
        "(<readings={float32}@CLIENTS,threshold=float32@SERVER> -> float32@SERVER)"
    )
    assert result["average"] == pytest.approx(69.5333, abs=1e-4)
    assert result["fraction"] == pytest.approx(1 / 3)
    out = capsys.readouterr().out
    assert "({float32}@CLIENTS -> float32@SERVER)" in out
    assert "[68.5, 70.3, 69.8] -> 69.53" in out
    assert "(<reading=float32,threshold=float32> -> float32)" in out


@pytest.mark.parametrize(
    ("threshold", "expected"), [(60.0, 1.0), (69.0, 2 / 3), (70.0, 1 / 3), (75.0, 0.0)]
)
def test_fraction_above_threshold(example, threshold, expected):
    fraction = example.get_fraction_of_clients_above_threshold([68.5, 70.3, 69.8], threshold)
    assert float(fraction) == pytest.approx(expected)


def test_local_computation_runs_directly(example):
    assert str(example.exceeds_threshold.type_signature) == (
        "(<reading=float32,threshold=float32> -> float32)"
    )
    assert float(example.exceeds_threshold(np.float32(71.0), np.float32(70.0))) == 1.0
    assert float(example.exceeds_threshold(np.float32(70.0), np.float32(70.0))) == 0.0


def test_average_of_many_clients(example):
    readings = np.linspace(60.0, 80.0, 101, dtype=np.float32)
    assert float(example.get_average_temperature(list(readings))) == pytest.approx(70.0, abs=1e-4)
