"""The local node cleans up after a crashed earlier run, and refuses to run twice at once.

Its own module: the node of test_localnode.py must be stopped (module fixtures are torn down
between modules), as these tests start nodes of their own.
"""

from __future__ import annotations

import pytest
from kmock_support import kube_emulator
from localnode import LocalNode, local_node, network


def test_leftovers_of_a_crashed_node_are_removed() -> None:
    name = f"{network.PREFIX}-65000"
    network.ip("netns", "add", name)
    network.ip("link", "add", f"{network.PREFIX}65000h", "type", "veth", "peer", "name",
               f"{network.PREFIX}65000p")
    (network.ETC_NETNS / name).mkdir(parents=True, exist_ok=True)
    with kube_emulator() as emu, local_node(emu) as node:
        assert node.netns() == []
        assert f"{network.PREFIX}65000" not in network.ip("link", "show")
        assert not (network.ETC_NETNS / name).exists()
        with pytest.raises(network.NetworkError, match="another local node"):
            LocalNode(emu).start()
        assert network.BRIDGE in network.ip("link", "show")  # the failed one left it alone
    assert network.BRIDGE not in network.ip("link", "show")
    assert not network.ETC_NETNS.exists() or not list(network.ETC_NETNS.glob("cln-*"))
