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


def test_the_demo_plot_reads_at_a_glance():
    # arrange: the records `fedlang train` writes (train every round, eval every 2)
    records = [{"round": r, "metrics": {
        "train": {"client_work": {"train": {"loss": 2 / r, "accuracy": r / 10, "num_examples": 9}}},
        **({"eval": {"loss": 2.5 / r, "accuracy": r / 12}} if r % 2 == 0 else {})}}
        for r in range(1, 7)]
    # act
    fig = plots.build_figure(records, title="fedavg, mlp on digits")
    # assert: one panel per metric, train and eval together, labelled, nothing empty
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == ["Loss", "Accuracy"]
    assert [ax.get_ylabel() for ax in axes] == ["loss", "accuracy"]
    assert all(ax.get_xlabel() == "round" and ax.lines for ax in axes)
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["train", "eval"]
    assert fig.get_suptitle() == "fedavg, mlp on digits"
    assert all(float(x).is_integer() for x in axes[0].get_xticks())
