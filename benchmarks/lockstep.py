"""Two training processes taking turns, one step each, so that both sides of a comparison run on the
machine as it is at that moment. On this project's 2-core machine a process can run a quarter faster
or slower than another doing the same work minutes apart (docs/results/measured.md: the same
distillation step measured at 15.9 and 19.8 s in two sittings of one day), more than a 1.3x target's
margin; run one after the other, the two sides see different machines. In turns, a slow minute slows
a step of each.

The conductor (this process) starts both sides, lets them load together, then lets one step of one
side run while the other waits (blocked on a pipe, using no CPU), then one of the other, and so on;
it times each step from its go to its end. A side takes part by calling `step_begins()` before each
training step and `step_ends()` after it (a transformers callback for TRL, a wrapper of the trainer's
step for tfcli: `python -m benchmarks.lockstep tfcli ARGS` is `tfcli ARGS` with those two calls around
each step); without the conductor's pipes both calls do nothing.

    ours, theirs = conduct([tfcli_argv, trl_argv], [env, peer_env])   # output, return code, seconds
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass, field

PIPES = "BENCH_LOCKSTEP_FDS"  # "go_fd,say_fd" in a side's environment


def _fds() -> tuple[int, int] | None:
    value = os.environ.get(PIPES)
    return tuple(int(x) for x in value.split(",")) if value else None  # type: ignore[return-value]


def step_begins() -> None:
    """A side's next step is ready: tell the conductor, and wait for its turn."""
    if fds := _fds():
        os.write(fds[1], b"b")
        if os.read(fds[0], 1) != b"g":
            raise SystemExit("lockstep: the conductor went away")


def step_ends() -> None:
    if fds := _fds():
        os.write(fds[1], b"e")


@dataclass
class Side:
    proc: subprocess.Popen
    go: int
    say: int
    output: typing.IO
    errors: typing.IO
    step_s: list[float] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""

    def heard(self) -> bytes:
        return os.read(self.say, 1)


def conduct(argvs: list[list[str]], envs: list[dict] | None = None, cwd: str | None = None) -> list[Side]:
    """Start one process per argv (in its env, this process's by default), then run their steps in
    turns until all have ended -> each side's stdout and stderr (through files, so that no side
    blocks on a full pipe while the other runs), return code (side.proc.returncode) and seconds
    per step."""
    sides = []
    for argv, env in zip(argvs, envs or [dict(os.environ)] * len(argvs)):
        go_r, go_w = os.pipe()
        say_r, say_w = os.pipe()
        output = tempfile.TemporaryFile("w+")
        errors = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(
            argv,
            stdout=output,
            stderr=errors,
            text=True,
            cwd=cwd,
            env={**env, PIPES: f"{go_r},{say_w}"},
            pass_fds=(go_r, say_w),
        )
        os.close(go_r)
        os.close(say_w)
        sides.append(Side(proc, go_w, say_r, output, errors))
    waiting = [s for s in sides if s.heard() == b"b"]  # both loaded, each at its first step
    while waiting:
        for side in list(waiting):
            started = time.perf_counter()
            os.write(side.go, b"g")
            if side.heard() == b"e":
                side.step_s.append(time.perf_counter() - started)
                if side.heard() == b"b":
                    continue
            waiting.remove(side)  # it ended (or failed: its return code says which)
    for side in sides:
        os.close(side.go)
        side.proc.wait()
        os.close(side.say)
        side.output.seek(0)
        side.errors.seek(0)
        side.stdout, side.stderr = side.output.read(), side.errors.read()
    return sides


def tfcli_main(argv: list[str]) -> None:
    """`tfcli ARGV`, each training step between step_begins() and step_ends()."""
    from tfcli.cli import main
    from tfcli.engine.trainer import Trainer

    one_step = Trainer._train_step

    def in_turn(self):
        step_begins()
        try:
            return one_step(self)
        finally:
            step_ends()

    Trainer._train_step = in_turn
    sys.argv = ["tfcli", *argv]
    main()


if __name__ == "__main__":
    if sys.argv[1:2] == ["tfcli"]:
        tfcli_main(sys.argv[2:])
