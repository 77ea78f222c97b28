from tfcli.display import _fmt


def test_log_values_read_as_their_kind():
    assert _fmt("loss", 1.09861) == "1.0986"
    assert _fmt("lr", 1e-4) == "1.00e-04"
    assert _fmt("mfu", 0.391) == "39.1%"
    assert _fmt("ex_per_s", 98.1) == "98.1"  # a rate, not "98.1000"
    assert _fmt("tok_per_s", 12345.6) == "12,346"
    assert _fmt("step", 7) == "7"
