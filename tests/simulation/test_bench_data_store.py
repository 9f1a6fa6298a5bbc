import pathlib
import sys
import tempfile


def test_data_store_bench_writes_to_a_fresh_temporary_directory_and_says_where(load_script, monkeypatch, tmp_path,
                                                                                capsys):
    # Before: the default --dir was /work/bench-data, a directory of the machine it was written on.
    bench = load_script("bench/data_store.py")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["data_store.py", "--gigabytes", "0.0001", "--clients", "3", "--cohort", "2",
                                      "--rounds", "1"])
    bench.main()
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"Writing the store to {tmp_path}/fedlang-data-store-") and "deleted at the end" in first
    assert list(tmp_path.iterdir()) == []  # the temporary directory is gone too
    assert bench.store_dir("elsewhere") == pathlib.Path("elsewhere")
