"""`islands cross-store`: the cross-island store of islands that are separate jobs, hosted by a process of its own
(issue #35; islands.runtime.cross), so that no island's death takes the store with it.

By default island 0's first worker hosts the store, and the other islands lose it when island 0's job dies. This
command hosts it as `islands run --separate-jobs` does in its launcher (the same TCPStore server,
islands.runtime.launch.ranks.rendezvous_store) on a machine of your choice, until SIGTERM or SIGINT. It serves until
stopped: the store holds no record that the whole job is over (each island flags only itself finished, and a killed
island flags nothing), so there is nothing it could end on by itself.

It needs no token: with ISLANDS_TOKEN set on the islands, they sign every value they write and check the record
the first of them leaves in the store (cross/auth); the store only holds the bytes."""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading

from islands.cli_more import UsageError
from islands.runtime.cross import ADDR_ENV, HOST_STORE_ENV
from islands.runtime.launch.ranks import LaunchError, rendezvous_store
from islands.sync.outer.ps_service import advertised_host

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _advertised(host: str) -> str:
    """The address islands are told to reach the store by: --host, checked to resolve, else this machine's gloo
    interface (GLOO_SOCKET_IFNAME) or 127.0.0.1, as `islands ps-host` tells its clients."""
    if not host:
        try:
            return advertised_host()
        except RuntimeError as e:
            raise UsageError(f"{e}; or give --host ADDRESS") from None
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise UsageError(
            f"--host {host!r} is not an address or a name this machine can resolve ({reason}); give the address "
            "the islands reach this machine by, e.g. --host 10.0.0.5"
        ) from None
    return host


def serve_until_stopped() -> str:
    """Block until SIGTERM or SIGINT arrives; returns its name. The handlers are this call's only (the previous
    ones come back), so a stop is a normal return, not a KeyboardInterrupt's traceback."""
    stopped = threading.Event()
    received: list[str] = []

    def on_signal(signum, _frame):
        received.append(signal.Signals(signum).name)
        stopped.set()

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        while not stopped.wait(1.0):  # a timed wait: the handler runs between waits even where a lock would not wake
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return received[0]


def _cross_store(args) -> int:
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be 0..65535 (0: any free port, printed), got {args.port}")
    host = _advertised(args.host)
    try:
        server = rendezvous_store(args.port)  # listens on every interface; `host` is what the islands are told
    except LaunchError:
        raise UsageError(
            f"--port {args.port} is already in use on this machine; choose a free one, or --port 0 for any free port"
        ) from None
    print(
        f"islands cross-store: serving; run every island with {ADDR_ENV}={host}:{server.port} {HOST_STORE_ENV}=0",
        flush=True,
    )
    why = serve_until_stopped()
    print(f"islands cross-store: stopped ({why})", file=sys.stderr, flush=True)
    del server  # the islands still connected lose the store here, as they would with its host's death
    return 0


def add_cross_store_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cross-store",
        help="host the cross-island store of islands that are separate jobs (ISLANDS_CROSS_ADDR) on this machine",
        description=f"Host the store that islands run as separate jobs meet through (docs/frameworks.md), so that "
        f"island 0's job is not its host and its death does not end it. Prints the {ADDR_ENV} the islands use "
        f"(HOST:PORT); every island must then run with {HOST_STORE_ENV}=0 (by default island 0's first worker "
        "hosts the store itself). Serves one job, until SIGTERM or SIGINT (exit 0). Needs no token: with "
        "ISLANDS_TOKEN set on the islands, they sign everything they write and check the record the first of them "
        "leaves here; set it on every island, or on none.",
    )
    p.add_argument("--port", type=int, required=True, help="the store's TCP port (0: any free one, printed)")
    p.add_argument(
        "--host",
        default="",
        help="the address the islands reach this machine by, printed in the ISLANDS_CROSS_ADDR line (the store "
        "listens on every interface; default: the interface in GLOO_SOCKET_IFNAME, else 127.0.0.1)",
    )
    p.set_defaults(fn=_cross_store)
