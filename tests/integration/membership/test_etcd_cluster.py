"""The test clusters' own start (islands.testbed.etcd.EtcdCluster.start): a member that exits while a new cluster
starts (its port taken in between) makes the cluster start again on fresh ports; a cluster that cannot start says
which member exited and shows its log."""

from __future__ import annotations

import socket

import pytest

import islands.testbed.etcd as etcd_cluster

pytestmark = pytest.mark.skipif(
    not etcd_cluster.available(), reason="etcd-server is not installed (apt-get install etcd-server)"
)


def _squat(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_member_whose_port_was_taken_starts_again_on_fresh_ports():
    cluster = etcd_cluster.EtcdCluster(1)
    taken = cluster.client_ports[0]
    squatter = _squat(taken)
    try:
        cluster.start(timeout=30)
        assert cluster.client_ports[0] != taken
        assert cluster.healthy(0)
        assert cluster.client().get(b"absent") is None
    finally:
        cluster.stop()
        squatter.close()


def test_a_cluster_that_cannot_start_names_the_member_and_shows_its_log():
    cluster = etcd_cluster.EtcdCluster(1)
    squatter = _squat(cluster.peer_ports[0])
    try:
        with pytest.raises(RuntimeError, match=r"member\(s\) \[0\] exited") as failed:
            cluster.start(timeout=30, attempts=1)
        assert "--- m0" in str(failed.value)
        assert "address already in use" in str(failed.value)
        assert not cluster.root.exists()  # nothing left behind
    finally:
        squatter.close()
