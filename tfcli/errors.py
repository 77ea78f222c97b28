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
