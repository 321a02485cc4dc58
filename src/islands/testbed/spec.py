"""What a testbed is asked to be: validated name, host count, link rate, subnet and tbf shape.

Everything here is pure (no system calls) so bad input fails before anything is created.
"""

from __future__ import annotations

import ipaddress
import math
import re

NAME_PATTERN = re.compile(r"[a-z0-9-]{1,12}")
MIN_HOSTS, MAX_HOSTS = 2, 64
_RATE_PATTERN = re.compile(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)")
_UNIT_BITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}  # tc's units are SI (powers of 10)
MIN_RATE_BPS, MAX_RATE_BPS = 100 * 10**3, 10 * 10**9

# tbf shape. FACTS.md: "tbf rate 100mbit burst 64kb latency 100ms" on both veth ends gave 93 Mbit/s
# of TCP. We keep exactly that at 100mbit and scale the burst with the rate so it stays ~5 ms of
# traffic (a fixed 64 KiB would starve a 10gbit link and let a 500kbit link burst for a second).
_BURST_AT_100MBIT = 64 * 1024
_FRAME_BYTES = 1514  # Ethernet frame for a 1500-byte MTU, as tbf and /sys count it (no FCS)
_MIN_BURST = 4 * _FRAME_BYTES  # tbf drops packets larger than its bucket, so never below a few frames
QUEUE_SECONDS = 0.1  # the "latency 100ms" of FACTS.md, expressed as a byte limit
_MIN_QUEUE = 64 * _FRAME_BYTES  # slow links still queue a TCP window's worth instead of dropping


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"testbed name {name!r} is invalid: use 1 to 12 characters from a-z, 0-9 and '-' "
            "(for example 'wan' or 'tb-1')"
        )
    return name


def validate_hosts(hosts: object) -> int:
    if isinstance(hosts, bool) or not isinstance(hosts, int):
        raise TypeError(f"hosts must be an int between {MIN_HOSTS} and {MAX_HOSTS}, got {hosts!r}")
    if not MIN_HOSTS <= hosts <= MAX_HOSTS:
        raise ValueError(f"hosts must be between {MIN_HOSTS} and {MAX_HOSTS}, got {hosts}")
    return hosts


def parse_rate(rate: object) -> int:
    """'100mbit' -> 100_000_000 bits per second. Accepts kbit, mbit, gbit (SI, like tc)."""
    if not isinstance(rate, str):
        raise TypeError(f"rate must be a string like '100mbit', '1gbit' or '500kbit', got {rate!r}")
    match = _RATE_PATTERN.fullmatch(rate.strip().lower())
    if match is None:
        raise ValueError(
            f"rate {rate!r} is not understood: write a number and a unit kbit, mbit or gbit, "
            "for example '100mbit', '1gbit' or '500kbit'"
        )
    bps = round(float(match.group(1)) * _UNIT_BITS[match.group(2)])
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise ValueError(f"rate {rate!r} is out of range: choose between 100kbit and 10gbit")
    return bps


def format_rate(bps: int) -> str:
    """100_000_000 -> '100mbit' (the largest unit that keeps an integer, else plain bits, which tc
    also reads)."""
    for unit in ("gbit", "mbit", "kbit"):
        if bps % _UNIT_BITS[unit] == 0:
            return f"{bps // _UNIT_BITS[unit]}{unit}"
    return f"{bps}bit"


def hub_address(net: ipaddress.IPv4Network) -> str:
    """The hub's address on the bridge: the subnet's last usable one, clear of the hosts (which take the first)."""
    return str(net.broadcast_address - 1)


def tbf_burst_bytes(rate_bps: int) -> int:
    return max(_MIN_BURST, math.ceil(_BURST_AT_100MBIT * rate_bps / 100e6))


def tbf_limit_bytes(rate_bps: int) -> int:
    return tbf_burst_bytes(rate_bps) + max(_MIN_QUEUE, math.ceil(rate_bps / 8 * QUEUE_SECONDS))


def tbf_args(rate_bps: int) -> list[str]:
    """The tc arguments after `root` for one shaped link end."""
    return [
        "tbf",
        "rate",
        format_rate(rate_bps),
        "burst",
        str(tbf_burst_bytes(rate_bps)),
        "limit",
        str(tbf_limit_bytes(rate_bps)),
    ]


def choose_subnet(subnet: str | None, hosts: int, taken: list[str]) -> ipaddress.IPv4Network:
    """The caller's subnet after checks, or the first free 10.77.<k>.0/24 not used by another testbed."""
    taken_nets = [ipaddress.ip_network(t) for t in taken]
    if subnet is None:
        for k in range(256):
            candidate = ipaddress.IPv4Network(f"10.77.{k}.0/24")
            if not any(candidate.overlaps(t) for t in taken_nets):
                return candidate
        raise ValueError("all 256 default subnets 10.77.<k>.0/24 are taken; pass subnet= explicitly")
    if not isinstance(subnet, str):
        raise TypeError(f"subnet must be a string like '10.77.5.0/24', got {subnet!r}")
    try:
        net = ipaddress.ip_network(subnet, strict=True)
    except ValueError as exc:
        raise ValueError(f"subnet {subnet!r} is not an IPv4 network like '10.77.5.0/24': {exc}") from None
    if (
        not isinstance(net, ipaddress.IPv4Network)
        or not net.is_private
        or net.is_loopback
        or net.is_link_local
        or net.is_multicast
    ):
        raise ValueError(
            f"subnet {subnet!r} must be a private IPv4 range (10.0.0.0/8, 172.16.0.0/12 or "
            "192.168.0.0/16), not loopback or link-local"
        )
    if net.num_addresses - 3 < hosts:  # the hub's own address is the subnet's last (hub_address)
        raise ValueError(
            f"subnet {subnet!r} has room for {max(net.num_addresses - 3, 0)} hosts and the hub, {hosts} hosts asked"
        )
    clash = [str(t) for t in taken_nets if net.overlaps(t)]
    if clash:
        raise ValueError(f"subnet {subnet!r} overlaps another testbed's subnet {clash[0]}; choose another")
    return net
