from tfcli.display import _fmt


def test_log_values_read_as_their_kind():
    assert _fmt("loss", 1.09861) == "1.0986"
    assert _fmt("lr", 1e-4) == "1.00e-04"
    assert _fmt("mfu", 0.391) == "39.1%"
    assert _fmt("ex_per_s", 98.1) == "98.1"  # a rate, not "98.1000"
    assert _fmt("tok_per_s", 12345.6) == "12,346"
    assert _fmt("step", 7) == "7"


def test_the_bar_shows_the_first_steps_loss_before_any_log_line(monkeypatch):
    """A run shorter than its log interval printed nothing but the bar until its end: on a terminal the
    bar carries the first step's loss (one read), then each logged line's."""
    import torch

    from tfcli import display

    monkeypatch.setattr(display, "live", lambda: True)
    with display.TrainDisplay(total=50, start=0) as shown:
        shown.step(1, {"loss": torch.tensor(2.5)})
        assert shown.progress.tasks[0].fields["loss"] == "loss 2.5000"
        shown.step(2, {"loss": torch.tensor(9.0)})  # a later window's first step: the logged loss stays
        assert shown.progress.tasks[0].fields["loss"] == "loss 2.5000"
