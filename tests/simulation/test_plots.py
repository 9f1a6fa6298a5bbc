import pytest

from fedlang.simulation import plots

RECORDS = [{"round": r, "metrics": {"train": {"loss": 1 / r, "n": r}, "eval": {"accuracy": r / 10}}}
           for r in range(1, 6)]


def test_png_of_losses_and_accuracies(tmp_path):
    path = plots.plot_metrics(RECORDS, tmp_path / "sub" / "m.png", title="run")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in path.parent.iterdir()] == ["m.png"]  # no temp file left


def test_selected_keys_and_fallback_to_all_scalars(tmp_path):
    plots.plot_metrics(RECORDS, tmp_path / "a.png", keys=["n"])
    plots.plot_metrics([{"round": 1, "metrics": {"x": 1.0}}], tmp_path / "b.png")
    assert (tmp_path / "a.png").exists() and (tmp_path / "b.png").exists()


def test_nothing_to_plot_names_what_there_is(tmp_path):
    with pytest.raises(ValueError, match=r"found \['eval/accuracy', 'train/loss', 'train/n'\]"):
        plots.plot_metrics(RECORDS, tmp_path / "m.png", keys=["missing"])
    with pytest.raises(ValueError, match="no scalar metrics"):
        plots.plot_metrics([], tmp_path / "m.png")
