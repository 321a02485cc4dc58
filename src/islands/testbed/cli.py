"""`islands testbed up|down|status|cut|heal`: plain-argument functions the main CLI wires to argparse.

Each returns data (for tests and scripts) and prints with rich. Errors are raised, not printed:
ValueError/TypeError for bad input (the CLI maps them to exit code 2), PermissionError when not
root, TestbedError when a system command fails.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from islands.testbed import lifecycle, measure
from islands.testbed.model import Testbed

DEFAULT_NAME = "default"


def cmd_up(
    hosts: int,
    rate: str,
    name: str = DEFAULT_NAME,
    subnet: str | None = None,
    measure_seconds: float = 2.0,
    console: Console | None = None,
) -> dict:
    """Bring testbed `name` up, measure host 0 -> host 1 for `measure_seconds` (0 skips it), and
    return its record (the dict run.json stores)."""
    console = console or Console()
    tb = lifecycle.up(name, hosts, rate, subnet)
    try:
        if measure_seconds:
            measure.measure_rate(tb, 0, 1, measure_seconds)
    except BaseException:
        lifecycle.down(name)  # a testbed whose probe crashed is not one to leave running
        raise
    record = tb.record()
    table = Table(title=f"testbed {tb.name} is up", show_header=True)
    for column in ("host", "namespace", "interface", "address"):
        table.add_column(column)
    for h in tb.hosts:
        table.add_row(str(h.index), h.netns, h.ifname, h.ip)
    console.print(table)
    console.print(f"links: {tb.qdisc} (both directions); latency not emulated")
    if tb.measured:
        m = tb.measured
        verdict = "ok" if measure.rate_within(m) else "OUTSIDE 10% of configured"
        console.print(
            f"measured host 0 -> 1: {m['goodput_mbit']:.1f} Mbit/s TCP goodput, "
            f"{m['wire_mbit']:.1f} Mbit/s on the wire, configured {m['configured_mbit']:g} ({verdict})"
        )
    return record


def cmd_down(name: str | None = None, all_testbeds: bool = False, console: Console | None = None) -> list[dict]:
    """Take testbed `name` (default 'default') or, with all_testbeds, every testbed down.
    Idempotent: taking down what is not there succeeds and says so."""
    console = console or Console()
    if name is not None and all_testbeds:
        raise ValueError("give either a testbed name or --all, not both")
    results = lifecycle.down_all() if all_testbeds else [lifecycle.down(name or DEFAULT_NAME)]
    if not results:
        console.print("no testbeds to take down")
    for r in results:
        if r["removed_netns"] or r["removed_state"]:
            console.print(f"testbed {r['name']} is down ({len(r['removed_netns'])} namespaces removed)")
        else:
            console.print(f"testbed {r['name']} was not up; nothing to remove")
        for ns, pids in r["lingering_pids"].items():
            console.print(f"[yellow]note:[/] processes {pids} were still running in {ns}; its link is gone")
    return results


def cmd_link(action: str, name: str, host: int, console: Console | None = None) -> bool:
    """`cut` or `heal` host `host`'s link of testbed `name`; returns whether the link is cut afterwards."""
    console = console or Console()
    tb = Testbed.load(name)
    tb.host(host)  # a ValueError naming the valid range
    {"cut": tb.cut, "heal": tb.heal}[action](host)
    cut = tb.is_cut(host)
    console.print(f"testbed {name}: host {host}'s link is {'cut' if cut else 'up'}")
    return cut


def cmd_status(console: Console | None = None) -> list[dict]:
    console = console or Console()
    rows = lifecycle.status()
    if not rows:
        console.print("no testbeds")
        return rows
    table = Table(title="testbeds")
    for column in ("name", "state", "hosts", "rate", "subnet", "master", "namespaces", "measured Mbit/s"):
        table.add_column(column)
    for r in rows:
        measured = r["measured_goodput_mbit"]
        table.add_row(
            r["name"],
            r["state"],
            _text(r["hosts"]),
            _text(r["rate"]),
            _text(r["subnet"]),
            _text(r["master_addr"]),
            f"{r['namespaces']}/{_text(r['expected_namespaces'])}",
            "-" if measured is None else f"{measured:.1f}",
        )
    console.print(table)
    return rows


def _text(value) -> str:
    return "-" if value is None else str(value)
