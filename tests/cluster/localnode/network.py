"""Pod networking: one network namespace per pod on a bridge, and hosts files for Service DNS.

This is the part of the node that plays the CNI plugin, kube-proxy and CoreDNS. Every pod gets
its own network namespace (so every pod can bind its declared port on 0.0.0.0 and gets a real
IP), joined by a veth pair to the bridge ``clnode0`` in the root namespace, whose address is
the pods' default gateway and where the API proxy listens. Names are resolved through
``/etc/netns/<netns>/hosts``, which ``ip netns exec`` bind-mounts over ``/etc/hosts`` for the
processes it starts: no DNS server, no virtual IPs.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shutil
import subprocess
from pathlib import Path
from typing import IO

PREFIX = "cln"  # every netns (cln-<n>), veth (cln<n>h) and /etc/netns dir the node makes
BRIDGE = "clnode0"
SUBNET = ipaddress.IPv4Network("10.244.0.0/16")
GATEWAY = SUBNET.network_address + 1  # the bridge's address: pods' route out, the API proxy
ETC_NETNS = Path("/etc/netns")
LOCK_PATH = Path("/var/tmp/cleave-localnode.lock")


class NetworkError(RuntimeError):
    """An ``ip`` command failed, or this machine cannot host pods (not root, no netns)."""


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; its stdout, or :class:`NetworkError` with its stderr."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def preflight() -> IO[str]:
    """Fail loudly (never skip) where pods cannot run; returns the held node lock.

    The lock makes a second node on the machine fail at once instead of tearing down the
    first one's bridge as a crashed run's leftovers.
    """
    if os.geteuid() != 0:
        raise NetworkError("the local node must run as root: it creates network namespaces, "
                           "veth pairs, a bridge and bind mounts")
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        raise NetworkError("the local node needs `ip` (iproute2) and `nsenter` (util-linux)")
    try:
        ip("netns", "list")
    except (NetworkError, OSError) as e:
        raise NetworkError(f"`ip netns` does not work here: {e}") from e
    lock = LOCK_PATH.open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise NetworkError(f"another local node holds {LOCK_PATH}") from None
    return lock


def netns_pids(netns: str) -> list[int]:
    """Every process in a pod's network namespace: the pod's 'cgroup' for a final kill."""
    return [int(p) for p in ip("netns", "pids", netns, check=False).split()]


def _kill_netns(netns: str) -> None:
    for pid in netns_pids(netns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)


def remove_leftovers() -> None:
    """Remove what a crashed earlier node left: its netns (and their processes), veths, bridge
    and /etc/netns dirs. Only names with the node's prefix are touched."""
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"{PREFIX}-"):
            _kill_netns(name)
            ip("netns", "delete", name, check=False)
    for line in ip("-o", "link", "show").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name == BRIDGE or (name.startswith(PREFIX) and name.endswith("h")):
            ip("link", "delete", name, check=False)
    if ETC_NETNS.is_dir():
        for d in ETC_NETNS.glob(f"{PREFIX}-*"):
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            ETC_NETNS.rmdir()  # only if nothing else uses it


def bridge_up() -> None:
    ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")


def bridge_down() -> None:
    ip("link", "delete", BRIDGE, check=False)
    with contextlib.suppress(OSError):
        ETC_NETNS.rmdir()


class PodNetwork:
    """The network namespace ``cln-<n>`` of one pod, with IP ``10.244.0.0 + n``."""

    def __init__(self, n: int) -> None:
        if not 2 <= n < SUBNET.num_addresses - 1:
            raise NetworkError(f"no pod address left in {SUBNET}")
        self.netns, self.veth = f"{PREFIX}-{n}", f"{PREFIX}{n}h"
        self.ip = str(SUBNET.network_address + n)
        self.etc = ETC_NETNS / self.netns
        self.hosts_size = 0

    def create(self, hosts: str, passwd: str | None = None) -> None:
        """The netns with ``lo`` and ``eth0`` up, a default route via the bridge, and its
        hosts and resolv.conf files (no nameserver is reachable: names come from hosts);
        ``passwd`` replaces /etc/passwd in the pod (``ip netns exec`` mounts them all)."""
        self.etc.mkdir(parents=True, exist_ok=True)
        (self.etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions attempts:1\n")
        if passwd is not None:
            (self.etc / "passwd").write_text(passwd)
        (self.etc / "hosts").touch()
        self.write_hosts(hosts)
        peer = f"{PREFIX}{self.netns.split('-')[1]}p"
        ip("netns", "add", self.netns)
        ip("link", "add", self.veth, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", self.netns)
        ip("link", "set", self.veth, "master", BRIDGE, "up")
        ns = ("-n", self.netns)
        ip(*ns, "link", "set", peer, "name", "eth0")
        ip(*ns, "addr", "add", f"{self.ip}/{SUBNET.prefixlen}", "dev", "eth0")
        ip(*ns, "link", "set", "eth0", "up")
        ip(*ns, "link", "set", "lo", "up")
        ip(*ns, "route", "add", "default", "via", str(GATEWAY))

    def write_hosts(self, content: str) -> None:
        """Rewrite the hosts file in place with one write: running pods see it through a bind
        mount of this inode, so a rename would go unseen. Padding with blank lines (ignored
        by the resolver) instead of truncating means no reader sees a cut-off file."""
        data = content.encode()
        with open(self.etc / "hosts", "r+b") as f:
            f.write(data.ljust(self.hosts_size, b"\n"))
        self.hosts_size = max(self.hosts_size, len(data))

    def delete(self) -> None:
        """Kill whatever still runs in the netns, then remove it, its veth and its files."""
        _kill_netns(self.netns)
        ip("netns", "delete", self.netns, check=False)
        ip("link", "delete", self.veth, check=False)
        shutil.rmtree(self.etc, ignore_errors=True)


def hosts_file(own_ip: str, own_names: list[str], records: dict[str, list[str]]) -> str:
    """A pod's hosts file: localhost, the pod's own names, then one line per (IP, names)."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{own_ip}\t{' '.join(own_names)}"]
    lines += [f"{addr}\t{' '.join(names)}" for addr, names in records.items()]
    return "\n".join(lines) + "\n"
