"""A tools file that a run's config.yaml names (never the command line): importing it leaves a mark
at $TFCLI_HOSTILE_MARK, which the tests check is never made unless the command line names this file."""

import os
from pathlib import Path

Path(os.environ.get("TFCLI_HOSTILE_MARK", "tfcli-hostile-mark")).write_text("imported")


def fn(x: int) -> int:
    """A tool.

    Args:
        x: A number.
    """
    return x


class Env:
    def reset(self, **row):
        return None

    def act(self, x: int) -> int:
        """Act.

        Args:
            x: A number.
        """
        return x
