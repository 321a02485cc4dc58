"""A testbed as data: its hosts, their addresses, and what a launcher needs to start workers on them.

Topology (a star): every host is a network namespace `isl-<name>-h<i>` holding one veth end
`isl-h<i>`; the other end `port<i>` sits in a hub namespace `isl-<name>-hub` and is enslaved to
the bridge `br0` there. The hub namespace keeps the root namespace untouched: no link, bridge or
address of a testbed ever appears in `ip link` of the host machine, and deleting the hub destroys
every veth pair at once.
"""

from __future__ import annotations

import re
import sys
from dataclasses import asdict, dataclass, field

from islands.testbed import spec, state, system

LATENCY_NOTE = "tc netem is not available on these machines, so only bandwidth is shaped (no added delay)"
SHAPED = "egress of both veth ends of every host link: each host's upload and download"


def host_netns(name: str, index: int) -> str:
    return f"isl-{name}-h{index}"


def hub_netns(name: str) -> str:
    return f"isl-{name}-hub"


def host_ifname(index: int) -> str:
    return f"isl-h{index}"  # inside the host's own namespace, so it need not carry the testbed name


def hub_port(index: int) -> str:
    return f"port{index}"


_OWNED = re.compile(r"isl-([a-z0-9-]{1,12})-(hub|h\d+)")


def testbed_of_netns(netns: str) -> str | None:
    """'isl-wan-h3' -> 'wan'; None for namespaces that are not a testbed's. The last '-hub'/'-h<i>'
    segment decides, so 'isl-a-h0-h1' is host 1 of testbed 'a-h0', never a host of testbed 'a'."""
    match = _OWNED.fullmatch(netns)
    return match.group(1) if match else None


class TestbedNotFound(LookupError):
    __test__ = False


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    ip: str
    ifname: str
    hub_port: str


@dataclass
class Testbed:
    __test__ = False  # not a pytest test class, despite the name

    name: str
    rate_bps: int
    subnet: str
    hosts: list[Host]
    hub: str
    phase: str = "up"  # "building" while `up` runs; a crashed builder leaves it behind
    builder_pid: int = 0
    created_at: float = 0.0
    measured: dict | None = None  # the last measure_rate() result
    extra: dict = field(default_factory=dict)
    hub_ip: str = ""  # the hub's address on the bridge (testbeds built before it existed have none)

    # ---- what a launcher calls -------------------------------------------------------------
    @property
    def master_addr(self) -> str:
        return self.hosts[0].ip

    @property
    def rate(self) -> str:
        return spec.format_rate(self.rate_bps)

    @property
    def qdisc(self) -> str:
        return " ".join(spec.tbf_args(self.rate_bps))

    def host(self, host_index: int) -> Host:
        if isinstance(host_index, bool) or not isinstance(host_index, int):
            raise TypeError(f"host_index must be an int, got {host_index!r}")
        if not 0 <= host_index < len(self.hosts):
            raise ValueError(f"host_index {host_index} is outside 0..{len(self.hosts) - 1} of testbed {self.name!r}")
        return self.hosts[host_index]

    def host_for_rank(self, rank: int) -> int:
        """Ranks go round-robin over hosts: rank r runs on host r % hosts."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        return rank % len(self.hosts)

    def wrap(self, host_index: int, argv: list[str]) -> list[str]:
        """argv run inside host `host_index`'s namespace (via `ip netns exec`)."""
        if isinstance(argv, str) or not all(isinstance(a, str) for a in argv):
            raise TypeError(f"argv must be a list of strings, got {argv!r}")
        return system.netns_exec_prefix(self.host(host_index).netns) + list(argv)

    def wrap_hub(self, argv: list[str]) -> list[str]:
        """argv run inside the hub's namespace, where the bridge and hub_ip are (an elastic job's store)."""
        self.require_hub_ip()
        return system.netns_exec_prefix(self.hub) + list(argv)

    def require_hub_ip(self) -> str:
        if not self.hub_ip:
            raise TestbedNotFound(
                f"testbed {self.name!r} was built before hubs had an address; rebuild it with "
                f"`islands testbed up --name {self.name} --hosts {len(self.hosts)} --rate {self.rate}`"
            )
        return self.hub_ip

    # ---- faults ------------------------------------------------------------------------------
    def cut(self, host_index: int) -> None:
        """Take host `host_index`'s link down at the hub: the host keeps its address and loopback (its own
        processes still talk to each other) but reaches nothing beyond, and nothing reaches it."""
        system.ip("link", "set", self.host(host_index).hub_port, "down", netns=self.hub)

    def heal(self, host_index: int) -> None:
        """Bring a cut link back; connections that have not timed out carry on. The neighbour entries that failed
        while it was cut are flushed on both sides, so a new connection does not meet a cached "no route to
        host" for the next second."""
        host = self.host(host_index)
        system.ip("link", "set", host.hub_port, "up", netns=self.hub)
        system.ip("neigh", "flush", "dev", host.ifname, netns=host.netns, check=False)
        system.ip("neigh", "flush", "dev", "br0", netns=self.hub, check=False)

    def is_cut(self, host_index: int) -> bool:
        out = system.ip("-o", "link", "show", self.host(host_index).hub_port, netns=self.hub).stdout
        flags = out.partition("<")[2].partition(">")[0].split(",")  # "<BROADCAST,MULTICAST,UP,LOWER_UP>"
        return "UP" not in flags

    def env(self, host_index: int) -> dict[str, str]:
        """Environment additions for a worker on this host: gloo bound to the host's link, the
        rendezvous on host 0, and proxies off (a proxy would be unreachable from the namespace)."""
        host = self.host(host_index)
        no_proxy = f"{self.subnet},{','.join(h.ip for h in self.hosts)},127.0.0.1,localhost"
        return {
            "GLOO_SOCKET_IFNAME": host.ifname,
            "TP_SOCKET_IFNAME": host.ifname,  # tensorpipe (torch RPC) reads its own variable
            "MASTER_ADDR": self.master_addr,
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
            "HTTP_PROXY": "",
            "http_proxy": "",
            "HTTPS_PROXY": "",
            "https_proxy": "",
            "ALL_PROXY": "",
            "all_proxy": "",
            "ISLANDS_TESTBED": self.name,
            "ISLANDS_TESTBED_HOST": str(host.index),
        }

    def free_port(self, host_index: int = 0) -> int:
        """A TCP port free on the host's address (asks the kernel inside the namespace for port 0)."""
        host = self.host(host_index)
        code = f"import socket; s = socket.socket(); s.bind(({host.ip!r}, 0)); print(s.getsockname()[1])"
        done = system.in_netns(host.netns, [sys.executable, "-I", "-S", "-c", code])
        return int(done.stdout.strip())

    def record(self) -> dict:
        """The interconnect as it goes into run.json."""
        measured = self.measured or {}
        return {
            "testbed": self.name,
            "hosts": len(self.hosts),
            "subnet": self.subnet,
            "rate": self.rate,
            "rate_mbit": self.rate_bps / 1e6,
            "qdisc": self.qdisc,
            "shaped": SHAPED,
            "topology": "star: host namespaces -> veth -> bridge br0 in hub namespace " + self.hub,
            "latency_emulated": False,
            "latency_note": LATENCY_NOTE,
            "measured_goodput_mbit": measured.get("goodput_mbit"),
            "measured_wire_mbit": measured.get("wire_mbit"),
            "measured": self.measured,
        }

    # ---- persistence -----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Testbed:
        data = dict(data)
        data["hosts"] = [Host(**h) for h in data["hosts"]]
        return cls(**data)

    def save(self) -> None:
        state.save(self.name, self.to_dict())

    @classmethod
    def load(cls, name: str) -> Testbed:
        spec.validate_name(name)
        data = state.load(name)
        if data is None:
            known = ", ".join(state.saved_names()) or "none"
            raise TestbedNotFound(
                f"no testbed named {name!r} (known: {known}); start one with `islands testbed up --name {name}`"
            )
        return cls.from_dict(data)
