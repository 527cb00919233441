"""Hosts for two-host tests: network namespaces joined by veth pairs to one bridge.

Each `Host` is a namespace with one veth interface and its own address; the other end of every veth joins a
bridge in the test's own namespace, which holds one address of the subnet too, so the test (and an in-process
router) reaches every host, and host-to-host traffic crosses two veth links as it would a switch. Everything is
made by the test and deleted when it ends; servers inside a host listen on that host's address only.

Impairments act on one host's interface: `cut_from(other)` drops its traffic to and from one peer (nftables),
`loss(pct)` drops that share of everything it sends, `delay(ms)` adds latency (tc netem, where the kernel has
it), `rate(mbit)` caps its bandwidth (tc tbf). Needs root and `ip`; `unavailable()` says why not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

SUBNET_FIRST_OCTETS = "10.231"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> Optional[str]:
    """Why two-host tests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"tdprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def has_netem() -> bool:
    """Whether this kernel has tc's netem qdisc (some VMs' kernels do not)."""
    ns = f"tdnetem{os.getpid()}"
    _ip("netns", "add", ns)
    try:
        out = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                              "delay", "1ms"], capture_output=True, text=True, timeout=30)
        return out.returncode == 0
    finally:
        _ip("netns", "del", ns, check=False)


def has_nft() -> bool:
    return shutil.which("nft") is not None


class Host:
    def __init__(self, net: "Network", index: int) -> None:
        self.net = net
        self.ns = f"{net.prefix}h{index}"
        self.iface = f"{net.prefix}i{index}"  # inside the namespace
        self.peer = f"{net.prefix}b{index}"  # on the bridge
        self.addr = f"{net.subnet}.{index + 1}"

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def sh(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.exec_prefix(), *cmd], capture_output=True, text=True, check=True, timeout=30)

    def _up(self) -> None:
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.iface, "type", "veth", "peer", "name", self.peer)
        _ip("link", "set", self.iface, "netns", self.ns)
        _ip("link", "set", self.peer, "master", self.net.bridge, "up")
        _ip("-n", self.ns, "addr", "add", f"{self.addr}/24", "dev", self.iface)
        _ip("-n", self.ns, "link", "set", self.iface, "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")

    # ---- impairments

    def _nft(self, *rule: str) -> None:
        self.sh("nft", *rule)

    def _filter_table(self) -> None:
        if not getattr(self, "_table", False):
            self._nft("add", "table", "inet", "tidaltest")
            self._nft("add", "chain", "inet", "tidaltest", "out", "{ type filter hook output priority 0 ; }")
            self._nft("add", "chain", "inet", "tidaltest", "in", "{ type filter hook input priority 0 ; }")
            self._table = True

    def cut_from(self, other: "Host") -> None:
        """Drop every packet between this host and `other` (both ways): a cut link; others still reach it."""
        self._filter_table()
        self._nft("add", "rule", "inet", "tidaltest", "out", "ip", "daddr", other.addr, "drop")
        self._nft("add", "rule", "inet", "tidaltest", "in", "ip", "saddr", other.addr, "drop")

    def loss(self, percent: int) -> None:
        """Drop `percent`% of the packets this host sends, at random."""
        self._filter_table()
        self._nft("add", "rule", "inet", "tidaltest", "out", "numgen", "random", "mod", "100", "<",
                  str(percent), "drop")

    def delay(self, ms: int) -> None:
        self.sh("tc", "qdisc", "replace", "dev", self.iface, "root", "netem", "delay", f"{ms}ms")

    def rate(self, mbit: int) -> None:
        self.sh("tc", "qdisc", "replace", "dev", self.iface, "root", "tbf", "rate", f"{mbit}mbit",
                "burst", "64kb", "latency", "200ms")

    def heal(self) -> None:
        """Undo every impairment."""
        if getattr(self, "_table", False):
            self._nft("delete", "table", "inet", "tidaltest")
            self._table = False
        subprocess.run([*self.exec_prefix(), "tc", "qdisc", "del", "dev", self.iface, "root"],
                       capture_output=True, timeout=30)


class Network:
    """`n` hosts on one bridge; a context manager that deletes all of it on exit."""

    def __init__(self, n: int) -> None:
        pid = os.getpid()
        self.prefix = f"td{pid % 100000}"  # interface names stay within 15 characters
        self.subnet = f"{SUBNET_FIRST_OCTETS}.{pid % 200 + 20}"
        self.bridge = f"{self.prefix}br"
        self.gateway = f"{self.subnet}.254"  # the bridge's: the test's own namespace on the subnet
        self.hosts = [Host(self, i) for i in range(n)]

    def __enter__(self) -> "Network":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for h in self.hosts:
                h._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for h in self.hosts:
            _ip("link", "del", h.peer, check=False)  # the pair goes at once (a namespace's own goes lazily)
            _ip("netns", "del", h.ns, check=False)
        _ip("link", "del", self.bridge, check=False)
