def test_the_benchmark_runs_in_quick_mode_and_checks_its_sums(load_script, capsys):
    bench = load_script("bench/secagg.py")
    rows = bench.main(["--quick", "--samples", "1"])  # each measured row asserts its sum
    out = capsys.readouterr().out
    assert out.count("| 5 | 1,000 |") == 1 and out.count("| 20 | 1,000 |") == 3
    by = {(r["clients"], r["graph"]): r for r in rows}
    assert set(by) == {
        (5, "SecAgg+ = full"),
        (20, "SecAgg+"),
        (20, "full"),
        (20, "SecAgg+, 10% dropped"),
    }
    assert by[(20, "SecAgg+, 10% dropped")]["survivors"] == 18
    assert by[(20, "SecAgg+")]["degree"] == 18 and by[(20, "full")]["degree"] == 19
    # A sparser graph sends fewer shares: bytes, unlike times, are deterministic.
    assert by[(20, "SecAgg+")]["client_bytes"] < by[(20, "full")]["client_bytes"]
