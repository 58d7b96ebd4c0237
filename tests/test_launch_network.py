"""Several nodes: which interface gloo binds (the one that reaches MASTER_ADDR) and how a rank names the peers
a failed collective lost. The real two-node jobs are in tests/test_slurm_nodes.py."""

from __future__ import annotations

import socket

import psutil
import pytest

from run.launch import bind_gloo_to_master_interface, interface_to, lost_peer_line


def test_loopback_master_is_reached_through_lo_and_leaves_gloo_alone():
    assert interface_to("127.0.0.1") == ("lo", "127.0.0.1")
    environ = {"MASTER_ADDR": "localhost"}
    assert bind_gloo_to_master_interface(environ) is None and "GLOO_SOCKET_IFNAME" not in environ


def test_a_master_on_another_address_binds_gloo_to_the_interface_holding_it():
    own = [
        (name, a.address)
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if not own:
        pytest.skip("this machine has no IPv4 address besides loopback")
    name, address = own[0]
    environ = {"MASTER_ADDR": address}
    line = bind_gloo_to_master_interface(environ)
    assert environ["GLOO_SOCKET_IFNAME"] == name
    assert line == f"gloo: GLOO_SOCKET_IFNAME={name} ({address}), the interface that reaches MASTER_ADDR={address}"
    given = {"MASTER_ADDR": address, "GLOO_SOCKET_IFNAME": "ib0"}  # the user's choice wins
    assert bind_gloo_to_master_interface(given) is None and given["GLOO_SOCKET_IFNAME"] == "ib0"


def test_unresolvable_master_is_an_error_naming_it():
    with pytest.raises(OSError):
        interface_to("no-such-host.invalid")


HOSTS = [("node1", "10.77.0.11"), ("node1", "10.77.0.11"), ("node2", "10.77.0.12"), ("node2", "10.77.0.12")]


def test_lost_peer_is_named_from_gloos_message():
    error = (
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.77.0.12]:31337\nmore lines"
    )
    assert lost_peer_line(error, HOSTS, 1) == (
        "rank 1 on node1: lost rank(s) [2, 3] on node2 (10.77.0.12): "
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.77.0.12]:31337"
    )
    assert lost_peer_line("Timed out waiting 60000ms for recv operation to complete", HOSTS, 1) is None
    # a peer on the rank's own address (same node) cannot be told apart from the rank itself
    assert lost_peer_line("Connection closed by peer [10.77.0.11]:31337", HOSTS, 0) is None
