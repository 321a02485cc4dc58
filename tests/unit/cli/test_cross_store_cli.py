"""`islands cross-store` (islands.cli_cross): bad input exits 2 with a message naming what is wrong and what would be
right; a good start serves a store islands can use, and SIGTERM ends it with exit 0. The islands meeting through a
hosted store while island 0 dies: tests/integration/frameworks/test_frameworks.py."""

from __future__ import annotations

import datetime
import os
import re
import signal
import threading
import time

import torch.distributed as dist

from harness.cli import islands_cli
from islands.runtime.launch.ranks import rendezvous_store


def test_bad_input_exits_2_and_says_what_would_be_right(capsys):
    for port in ("70000", "-1"):
        assert islands_cli("cross-store", "--port", port) == 2
        err = capsys.readouterr().err
        assert f"--port must be 0..65535 (0: any free port, printed), got {port}" in err and "Traceback" not in err
    taken = rendezvous_store(0)  # another store on the port, as a second cross-store would be
    assert islands_cli("cross-store", "--port", str(taken.port)) == 2
    err = capsys.readouterr().err
    assert f"--port {taken.port} is already in use on this machine" in err and "--port 0 for any free port" in err
    assert islands_cli("cross-store", "--port", "0", "--host", "no-such-host.invalid") == 2
    err = capsys.readouterr().err
    assert "--host 'no-such-host.invalid' is not an address or a name this machine can resolve" in err
    assert "the address the islands reach this machine by" in err
    assert islands_cli("cross-store", "--host", "127.0.0.1") == 2  # argparse: the port is required
    assert "the following arguments are required: --port" in capsys.readouterr().err


def test_it_serves_the_printed_address_until_sigterm(capsys):
    """In this process: the printed ISLANDS_CROSS_ADDR reaches a store that keeps what a client sets; SIGTERM (sent
    once the command's handler is in place) ends it with exit 0 and the previous handler back."""
    before = signal.getsignal(signal.SIGTERM)
    seen: dict = {}

    def client():
        deadline = time.monotonic() + 60
        while signal.getsignal(signal.SIGTERM) is before and time.monotonic() < deadline:  # serving after this
            time.sleep(0.01)
        seen["out"] = capsys.readouterr().out
        said = re.search(r"ISLANDS_CROSS_ADDR=127\.0\.0\.1:(\d+) ISLANDS_CROSS_HOST_STORE=0", seen["out"])
        if said:
            store = dist.TCPStore("127.0.0.1", int(said.group(1)), timeout=datetime.timedelta(seconds=10))
            store.set("cross/probe", "held")
            seen["value"] = store.get("cross/probe")
        if signal.getsignal(signal.SIGTERM) is not before:  # else the command ended already: nothing to stop
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client)
    thread.start()
    code = islands_cli("cross-store", "--port", "0", "--host", "127.0.0.1")
    thread.join(10)
    assert code == 0
    assert seen.get("value") == b"held", seen
    assert "islands cross-store: stopped (SIGTERM)" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
