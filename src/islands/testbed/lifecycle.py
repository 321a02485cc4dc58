"""Bring a testbed up, take it down, and say what exists: idempotent and safe after a crash.

Crash safety rests on three rules:
1. everything a testbed creates lives inside namespaces whose names encode the testbed's name,
   so clean-up can find it from `ip netns list` alone, with or without a state file;
2. `up` records the testbed (phase "building") before it creates anything, removes leftovers of
   an earlier testbed of the same name first, and undoes its own work if it fails or is signalled;
3. deleting the hub namespace destroys every veth pair, so even a host namespace kept alive by a
   lingering process loses its link.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from islands.testbed import spec, state, system
from islands.testbed.model import (
    Host,
    Testbed,
    host_ifname,
    host_netns,
    hub_netns,
    hub_port,
    testbed_of_netns,
)

BRIDGE = "br0"


def up(name: str, hosts: int, rate: str, subnet: str | None = None) -> Testbed:
    """Create `hosts` namespaces joined by a bridge, every link shaped to `rate` in both directions."""
    name = spec.validate_name(name)
    hosts = spec.validate_hosts(hosts)
    rate_bps = spec.parse_rate(rate)
    taken = [d["subnet"] for n in state.saved_names() if n != name and (d := state.load(n))]
    net = spec.choose_subnet(subnet, hosts, taken)
    system.require_tools()
    system.require_root()
    addresses = list(net.hosts())[:hosts]
    with state.locked():
        _teardown(name)  # leftovers of a crashed testbed with this name
        tb = Testbed(
            name=name,
            rate_bps=rate_bps,
            subnet=str(net),
            hub=hub_netns(name),
            hub_ip=spec.hub_address(net),
            hosts=[Host(i, host_netns(name, i), str(addresses[i]), host_ifname(i), hub_port(i)) for i in range(hosts)],
            phase="building",
            builder_pid=os.getpid(),
            created_at=time.time(),
        )
        tb.save()  # before creating anything, so status/down from elsewhere see a half-built bed
        with _undone_on_failure(name):
            _build(tb, net.prefixlen)
        tb.phase = "up"
        tb.save()
    return tb


def down(name: str) -> dict:
    """Remove everything of testbed `name`. Succeeds when it is already gone or half built."""
    name = spec.validate_name(name)
    system.require_tools()
    system.require_root()
    with state.locked():
        return _teardown(name)


def down_all() -> list[dict]:
    """Remove every testbed: those with a state file and orphaned namespaces without one."""
    return [down(name) for name in _known_names(system.list_netns())]


def status() -> list[dict]:
    """One row per testbed that has a state file or namespaces: what exists right now."""
    system.require_tools()
    all_netns = system.list_netns()
    rows = []
    for name in _known_names(all_netns):
        present = sorted(ns for ns in all_netns if testbed_of_netns(ns) == name)
        data = state.load(name)
        if data is None:
            rows.append(
                {
                    "name": name,
                    "state": "orphaned",
                    "hosts": None,
                    "rate": None,
                    "subnet": None,
                    "master_addr": None,
                    "namespaces": len(present),
                    "expected_namespaces": None,
                    "measured_goodput_mbit": None,
                }
            )
            continue
        tb = Testbed.from_dict(data)
        expected = {tb.hub} | {h.netns for h in tb.hosts}
        if tb.phase == "building" and _alive(tb.builder_pid):
            phase = "building"
        elif expected <= set(present):
            phase = "up" if tb.phase == "up" else "partial"
        elif not present:
            phase = "down"  # a record without namespaces, e.g. after a reboot
        else:
            phase = "partial"
        rows.append(
            {
                "name": name,
                "state": phase,
                "hosts": len(tb.hosts),
                "rate": tb.rate,
                "subnet": tb.subnet,
                "master_addr": tb.master_addr,
                "namespaces": len(present),
                "expected_namespaces": len(expected),
                "measured_goodput_mbit": (tb.measured or {}).get("goodput_mbit"),
            }
        )
    return rows


# ---- internals -----------------------------------------------------------------------------
def _build(tb: Testbed, prefixlen: int) -> None:
    hub = tb.hub
    system.ip("netns", "add", hub)
    system.ip("link", "set", "lo", "up", netns=hub)
    system.ip("link", "add", BRIDGE, "type", "bridge", netns=hub)
    # No IPv6 link-local addresses: their neighbour discovery would add chatter to byte counters.
    system.ip("link", "set", "dev", BRIDGE, "addrgenmode", "none", netns=hub)
    system.ip("link", "set", BRIDGE, "up", netns=hub)
    # The hub's own address: an elastic job's store lives here, reached by every host over its own shaped link
    # (a cut link cuts the host off from the store too, as a real WAN cut would).
    system.ip("addr", "add", f"{tb.hub_ip}/{prefixlen}", "dev", BRIDGE, netns=hub)
    shape = spec.tbf_args(tb.rate_bps)
    for host in tb.hosts:
        system.ip("netns", "add", host.netns)
        system.ip("link", "set", "lo", "up", netns=host.netns)
        # Both veth ends are born in their namespaces: the root namespace never sees them.
        system.ip(
            "link", "add", host.hub_port, "type", "veth", "peer", "name", host.ifname, "netns", host.netns, netns=hub
        )
        system.ip("link", "set", "dev", host.hub_port, "addrgenmode", "none", netns=hub)
        system.ip("link", "set", host.hub_port, "master", BRIDGE, "up", netns=hub)
        system.ip("link", "set", "dev", host.ifname, "addrgenmode", "none", netns=host.netns)
        system.ip("addr", "add", f"{host.ip}/{prefixlen}", "dev", host.ifname, netns=host.netns)
        system.ip("link", "set", host.ifname, "up", netns=host.netns)
        # Upload: the host's egress. Download: the hub port's egress towards the host.
        system.tc("qdisc", "add", "dev", host.ifname, "root", *shape, netns=host.netns)
        system.tc("qdisc", "add", "dev", host.hub_port, "root", *shape, netns=hub)


def _teardown(name: str) -> dict:
    owned = [ns for ns in system.list_netns() if testbed_of_netns(ns) == name]
    owned.sort(key=lambda ns: not ns.endswith("-hub"))  # hub first: it takes every veth pair with it
    lingering = {ns: pids for ns in owned if (pids := system.netns_pids(ns))}
    removed = [ns for ns in owned if system.delete_netns(ns)]
    return {"name": name, "removed_netns": removed, "removed_state": state.remove(name), "lingering_pids": lingering}


@contextlib.contextmanager
def _undone_on_failure(name: str):
    """Tear the half-built testbed down on any exception, Ctrl-C or SIGTERM, then re-raise."""
    previous = None
    if threading.current_thread() is threading.main_thread():

        def _terminate(signum, frame):
            raise SystemExit(128 + signum)

        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    except BaseException as exc:
        try:
            _teardown(name)
        except Exception as cleanup_error:  # noqa: BLE001 - keep the original error; say clean-up also failed
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"clean-up of testbed {name!r} also failed: {cleanup_error}")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _known_names(all_netns: list[str]) -> list[str]:
    from_netns = {n for ns in all_netns if (n := testbed_of_netns(ns))}
    return sorted(from_netns | set(state.saved_names()))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
