"""The address the parameter server's supervisor tells the islands (ps_service.advertised_host): the IPv4 address of
the interface gloo is bound to, where the job names one (a testbed host, a multi-machine job), else loopback; an
interface that does not exist is named in the error."""

import pytest

from islands.sync.outer.ps_service import advertised_host


def test_the_gloo_interfaces_address_or_loopback():
    assert advertised_host({}) == "127.0.0.1"
    assert advertised_host({"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"  # the loopback interface's own address
    assert advertised_host({"GLOO_SOCKET_IFNAME": "lo,eth0"}) == "127.0.0.1"  # gloo's list: the first one


def test_an_interface_that_is_not_there_is_named():
    with pytest.raises(RuntimeError, match="GLOO_SOCKET_IFNAME='nosuch0' names no interface"):
        advertised_host({"GLOO_SOCKET_IFNAME": "nosuch0"})
