"""A refused, ended or dropped worker prints one line and exits with its error's code (islands.runtime.world's
excepthooks), even when torch's init_process_group ran after the hook was installed: torch wraps the hook it
finds in one that swaps sys.stderr for a buffer, and a line printed there vanished with the os._exit (an elastic
island of several workers makes its group after the hook is in place)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from islands.runtime.world import _one_line_exit

    class Dropped(RuntimeError):
        exit_code = 7

    sys.excepthook = _one_line_exit(lambda e: str(e) if isinstance(e, Dropped) else None, sys.excepthook)
    if sys.argv[1] == "group-after":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    raise Dropped("island1 was dropped by the others")
    """
)


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)


def test_the_line_survives_a_process_group_made_after_the_hook():
    done = _run("group-after")
    assert done.returncode == 7, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "islands: island1 was dropped by the others", done.stderr
    assert "Traceback" not in done.stderr


def test_other_errors_still_reach_the_previous_hook():
    script = SCRIPT.replace('raise Dropped("island1 was dropped by the others")', 'raise ValueError("a user bug")')
    done = subprocess.run([sys.executable, "-c", script, "group-after"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "ValueError: a user bug" in done.stderr and "Traceback" in done.stderr
