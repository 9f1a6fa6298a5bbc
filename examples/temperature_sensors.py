"""Temperature sensors: TFF's introduction to federated computations, in fedlang.

Each client is a sensor holding one temperature reading. Two federated computations:

* `get_average_temperature`: the mean reading, computed at the server.
* `get_fraction_of_clients_above_threshold`: the server broadcasts a threshold, each
  sensor reports 1.0 if its reading exceeds it (local JAX code), and the server
  averages the reports.

Run it with `python examples/temperature_sensors.py`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import fedlang as fl


@fl.federated_computation(fl.type_at_clients(np.float32))
def get_average_temperature(sensor_readings):
    """({float32}@CLIENTS -> float32@SERVER): the mean of all readings."""
    return fl.federated_mean(sensor_readings)


@fl.jax_computation(np.float32, np.float32)
def exceeds_threshold(reading, threshold):
    """(<reading=float32,threshold=float32> -> float32): 1.0 if reading > threshold, else 0.0."""
    return jnp.where(reading > threshold, 1.0, 0.0).astype(jnp.float32)


@fl.federated_computation(fl.type_at_clients(np.float32), fl.type_at_server(np.float32))
def get_fraction_of_clients_above_threshold(readings, threshold):
    """The fraction of clients whose reading is above the server's threshold."""
    # The threshold lives at the server; every client needs it, so broadcast it first.
    client_threshold = fl.federated_broadcast(threshold)
    # (readings, client_threshold) is a struct of CLIENTS values; federated_map zips it
    # into one {<float32,float32>}@CLIENTS value before applying the local function.
    above = fl.federated_map(exceeds_threshold, (readings, client_threshold))
    return fl.federated_mean(above)


def main(readings: list[float] | None = None, threshold: float = 70.0) -> dict[str, object]:
    """Prints the computations' type signatures and results; returns them too.

    Args:
      readings: one temperature per client (sensor).
      threshold: the threshold the server broadcasts.

    Returns:
      A dict with the type signatures (as strings), the average and the fraction.
    """
    readings = [68.5, 70.3, 69.8] if readings is None else readings
    average = get_average_temperature(readings)
    fraction = get_fraction_of_clients_above_threshold(readings, threshold)

    print("get_average_temperature")
    print(f"  type:   {get_average_temperature.type_signature}")
    print(f"  {readings} -> {average:.2f}")
    print("exceeds_threshold (local JAX code, run at each client)")
    print(f"  type:   {exceeds_threshold.type_signature}")
    print("get_fraction_of_clients_above_threshold")
    print(f"  type:   {get_fraction_of_clients_above_threshold.type_signature}")
    print(f"  {readings}, threshold {threshold} -> {fraction:.3f}")
    return {
        "average_type": str(get_average_temperature.type_signature),
        "average": float(average),
        "fraction_type": str(get_fraction_of_clients_above_threshold.type_signature),
        "fraction": float(fraction),
    }


if __name__ == "__main__":
    main()
