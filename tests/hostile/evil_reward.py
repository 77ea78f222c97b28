"""A reward file that a run's config.yaml names (never the command line): importing it leaves a mark at
$TFCLI_HOSTILE_MARK, which the tests check is never made unless the command line names this file."""

import os
from pathlib import Path

Path(os.environ.get("TFCLI_HOSTILE_MARK", "tfcli-hostile-mark")).write_text("imported")


def fn(completions, **kw):
    return [0.0 for _ in completions]
