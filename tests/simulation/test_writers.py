import collections
import csv
import doctest
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from fedlang.simulation import metrics, writers


def _record(r, evaluated=False):
    Metrics = collections.namedtuple("Metrics", ["loss", "accuracy"])
    m = {"train": {"client_work": {"train": Metrics(np.float32(1.0 / r), jnp.float32(0.5))}},
         "hist": np.arange(3), "round_time_s": 0.25}
    if evaluated:
        m["eval"] = {"accuracy": 0.75}
    return m


def test_to_python_and_flatten():
    flat = metrics.flatten_metrics(_record(2, evaluated=True))
    assert flat == {"train/client_work/train/loss": 0.5, "train/client_work/train/accuracy": 0.5,
                    "hist": [0, 1, 2], "round_time_s": 0.25, "eval/accuracy": 0.75}
    assert "hist" not in metrics.scalars(flat)
    assert metrics.to_python({"b": np.bool_(True), "i": np.int64(3), "t": (1, 2)}) == {
        "b": True, "i": 3, "t": [1, 2]}


def test_jsonl_keeps_nesting_and_truncates_on_resume(tmp_path):
    w = writers.JSONLinesWriter(tmp_path / "m.jsonl")
    w.truncate(0)
    for r in (1, 2, 3):
        w.write(r, _record(r))
    w.close()
    with open(tmp_path / "m.jsonl", "a") as f:
        f.write('{"round": 4, "metr')  # torn by a crash
    records = writers.read_jsonl(tmp_path / "m.jsonl")
    assert [r["round"] for r in records] == [1, 2, 3]
    assert records[0]["metrics"]["train"]["client_work"]["train"]["loss"] == 1.0
    w = writers.JSONLinesWriter(tmp_path / "m.jsonl")
    w.truncate(2)
    w.write(3, _record(3))
    w.close()
    assert [r["round"] for r in writers.read_jsonl(tmp_path / "m.jsonl")] == [1, 2, 3]


def test_jsonl_corrupt_middle_line_is_an_error(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"round": 1}\nnot json\n{"round": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        writers.read_jsonl(tmp_path / "m.jsonl")


def test_csv_widens_its_header_when_new_metrics_appear(tmp_path):
    w = writers.CSVWriter(tmp_path / "m.csv")
    w.truncate(0)
    w.write(1, _record(1))
    w.write(2, _record(2, evaluated=True))
    w.write(3, _record(3))
    w.close()
    with open(tmp_path / "m.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["round"] for r in rows] == ["1", "2", "3"]
    assert [r["eval/accuracy"] for r in rows] == ["", "0.75", ""]
    assert float(rows[2]["train/client_work/train/loss"]) == pytest.approx(1 / 3)
    writers.CSVWriter(tmp_path / "m.csv").truncate(1)
    assert (tmp_path / "m.csv").read_text().count("\n") == 2


def _read_events(logdir):
    """Parses TFRecord-framed Event protos, as TensorBoard does."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack_from("<Q", data, pos)
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + n])
            events.append(event)
            pos += 12 + n + 4
    return events


def test_tensorboard_event_files_hold_scalars_by_round(tmp_path):
    w = writers.TensorBoardWriter(tmp_path / "tb")
    w.truncate(0)
    w.write(1, _record(1))
    w.write(2, {"loss": float("nan"), "ok": 1.0})
    w.close()
    w = writers.TensorBoardWriter(tmp_path / "tb")
    w.truncate(1)  # resume after round 1: TensorBoard purges steps >= 2
    w.write(2, _record(2))
    w.close()
    events = _read_events(tmp_path / "tb")
    scalars = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]
    assert (1, "train/client_work/train/loss", 1.0) in scalars
    assert (2, "ok", 1.0) in scalars and not any(t == "loss" for _, t, _ in scalars)
    assert (2, "train/client_work/train/loss", 0.5) in scalars
    assert any(e.HasField("session_log") and e.step == 2 for e in events)


def test_plot_writer_draws_a_png_from_the_jsonl_history(tmp_path):
    j = writers.JSONLinesWriter(tmp_path / "m.jsonl")
    p = writers.PlotWriter(tmp_path / "m.png", jsonl_path=tmp_path / "m.jsonl")
    for r in (1, 2, 3):
        for w in (j, p):
            w.write(r, _record(r, evaluated=r == 3))
    j.close()
    p.close()
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_writers_write_every_file(tmp_path):
    ws = writers.default_writers(tmp_path)
    for w in ws:
        w.truncate(0)
        w.write(1, _record(1))
    for w in ws:
        w.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["metrics.csv", "metrics.jsonl", "metrics.png", "tensorboard"]


def test_docstring_example():
    result = doctest.testmod(metrics)
    assert result.attempted > 0 and result.failed == 0
