"""`run_training`'s progress bar (simulation/driver.py): the time per round and the ETA
come from one measurement, the wall time of whole rounds (issue 37, item 12c: the bar
showed 0.01 s/round, the training step alone, beside an ETA of minutes)."""

import re

from fedlang import simulation as sim
from fedlang.simulation import driver


class _Clock:
    """A clock the test moves: no test waits or asserts real time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_pace_is_the_time_of_whole_rounds_without_the_first():
    assert driver._pace([(0, 0.0), (1, 30.0)], total=5) == (30.0, 120.0)
    # the first round (compilation) is left out once a later round is done
    assert driver._pace([(0, 0.0), (1, 30.0), (2, 32.0), (3, 34.0)], total=5) == (2.0, 4.0)
    assert driver._pace([(4, 0.0), (5, 3.0), (6, 5.0)], total=6) == (2.0, 0.0)  # resumed


def test_the_bar_shows_the_rate_its_eta_is_computed_from(monkeypatch, capsys):
    clock = _Clock()
    monkeypatch.setattr(driver.time, "perf_counter", clock)

    class Process:  # a fast step, a slow evaluation: the rounds take 3.01 s each
        def initialize(self):
            return 0

        def next(self, state, data):
            clock.now += 0.01
            return state + 1, {"loss": 1.0}

    def evaluation(state):
        clock.now += 3.0
        return {"accuracy": 0.5}

    class Sampler:
        def sample(self):
            return ["a"]

    shown = []
    real = driver._Progress.update

    def update(self, round_num, flat):
        real(self, round_num, flat)
        task = self._bar.tasks[0]
        shown.append((task.fields["round_time"], task.fields["eta"]))

    monkeypatch.setattr(driver._Progress, "update", update)
    sim.run_training(Process(), lambda r, ids: ids, Sampler(), 4, evaluation=evaluation,
                     progress=True)
    capsys.readouterr()
    assert shown == [("3.01s/round", "0:00:09"), ("3.01s/round", "0:00:06"),
                     ("3.01s/round", "0:00:03"), ("3.01s/round", "0:00:00")]
    for rate, eta in shown:  # the ETA is the rate times the rounds left
        assert re.fullmatch(r"\d+\.\d\ds/round", rate) and re.fullmatch(r"\d+:\d\d:\d\d", eta)
