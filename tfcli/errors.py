"""The one exception type the CLI turns into a one-line message and exit code 2."""


class UserError(Exception):
    """A problem with what the user asked for (bad path, bad recipe, wrong checkpoint).

    Raised anywhere below the CLI; the CLI prints `error: <message>` and exits with code 2,
    so users never see a traceback for their own mistakes.
    """


class Interrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint at `step`."""

    def __init__(self, step: int, run_dir):
        super().__init__(f"interrupted at step {step}; a checkpoint was saved")
        self.step, self.run_dir = step, run_dir


def listing(items, most: int = 8) -> str:
    """'a, b, c' or, for a long list, its first `most` and 'and N more': an error stays one short line
    however many labels or columns the data has."""
    items = [str(i) for i in items]
    shown = ", ".join(short(i) for i in items[:most])
    return shown if len(items) <= most else f"{shown} and {len(items) - most:,} more"


def short(value, width: int = 40) -> str:
    """A value from the user's data as one short line (its repr cut in the middle of a long text)."""
    text = value if isinstance(value, str) and "\n" not in value else repr(value)
    return text if len(text) <= width else f"{text[: width - 11]}…{text[-10:]}"
