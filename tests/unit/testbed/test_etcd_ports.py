"""An etcd test cluster's ports come from below the kernel's ephemeral range, where no bind(0) and no outgoing
connection of the suite running beside it can take them between the choice and the member's bind."""

from __future__ import annotations

import socket

from islands.testbed.etcd import _ephemeral_low, _free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    low = _ephemeral_low()
    ports = _free_ports(6)
    assert len(set(ports)) == 6
    assert all(10000 <= p < low for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free
