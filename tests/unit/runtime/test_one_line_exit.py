"""A refused, ended or dropped worker prints one line and exits with its error's code (islands.runtime.world's
excepthooks), even when torch's init_process_group ran after the hook was installed: torch wraps the hook it
finds in one that swaps sys.stderr for a buffer, and a line printed there vanished with the os._exit (an elastic
island of several workers makes its group after the hook is in place). A joined island (ISLANDS_CROSS_*) refused
before it joins does the same."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch.distributed as dist

from harness.procs import free_port
from islands.runtime.cross import ADDR_ENV, INDEX_ENV, ISLANDS_ENV, CrossSpec, check_token
from islands.runtime.elastic.membership import TOKEN_ENV, connect

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


def _init_world(env: dict) -> subprocess.CompletedProcess:
    """`islands.init_world()` in a fresh process with `env` added (no torchrun variables: an island of one)."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    code = "import islands; islands.init_world(); print('JOINED')"
    return subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120
    )


def test_a_joined_island_refused_at_the_start_prints_one_line():
    """ISLANDS_CROSS_* settings that cannot work (exit 2) and a token the islands' record refuses (exit 3) end the
    island before it joins, with the refusal's one line and no traceback (the hook is in place before joining)."""
    bad = _init_world({ADDR_ENV: "127.0.0.1:1", ISLANDS_ENV: "2", INDEX_ENV: "5"})
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines() == [
        f"islands: {INDEX_ENV} must be this island's index, 0..1 for 2 islands; got 5"
    ], bad.stderr
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    check_token(connect("127.0.0.1", port), "right", f"127.0.0.1:{port}", "0")  # the first island's record
    spec = CrossSpec(f"127.0.0.1:{port}", islands=2, index=1, host_store=False, token="wrong")
    refused = _init_world(spec.env())
    assert refused.returncode == 3, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith(f"islands: wrong token: this island's {TOKEN_ENV} is not the one"), refused.stderr
    assert "JOINED" not in refused.stdout
    del server
