"""The rate-limited link the bench runs ranks behind: a private network namespace per run, its
loopback shaped by ``tc`` (a token bucket, optional netem delay), and its interface counters."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
from typing import List, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Link:
    """A private network namespace with a rate-limited loopback, or nothing (unlimited)."""

    def __init__(self, bandwidth: Optional[str], latency: Optional[str]) -> None:
        self.bandwidth, self.latency, self.ns = bandwidth, latency, None
        if not bandwidth and not latency:
            return
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
            print("bench: --bandwidth/--latency need root and iproute2 (ip, tc); running UNLIMITED "
                  "on the host loopback instead", flush=True)
            self.bandwidth = self.latency = None
            return
        self.ns = f"lowcomm-bench-{os.getpid()}"
        self._ip("netns", "add", self.ns)
        try:
            self._ip("-n", self.ns, "link", "set", "lo", "up")
            parent = ["root"]
            if latency:
                self._tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem", "delay", latency)
                parent = ["parent", "1:"]
            if bandwidth:
                self._tc("qdisc", "add", "dev", "lo", *parent, "handle", "2:", "tbf", "rate", bandwidth,
                         "burst", "256kb", "latency", "100ms")
        except subprocess.CalledProcessError as err:
            self.close()
            raise SystemExit(f"bench: could not set up the limited link ({' '.join(err.cmd)} failed; "
                             f"--latency needs the kernel's netem qdisc, --bandwidth its tbf qdisc)")

    def _ip(self, *args):
        subprocess.run(["ip", *args], check=True)

    def _tc(self, *args):
        subprocess.run(["tc", "-n", self.ns, *args], check=True)

    nodes = 1

    def prefix(self, node: int = 0) -> List[str]:
        return ["ip", "netns", "exec", self.ns] if self.ns else []

    def node_env(self, node: int) -> dict:
        return {}

    def counters(self) -> Optional[int]:
        """Bytes sent on the limited link so far (None: no private link); train.py reads its
        own namespace's loopback, so this is only used for the two-node link."""
        return None

    def close(self) -> None:
        if self.ns:
            subprocess.run(["ip", "netns", "del", self.ns], check=False)
            self.ns = None


class TwoNodeLink(Link):
    """Two network namespaces ("nodes") joined by a veth pair rate-limited in each direction.

    Ranks of one node reach each other through their namespace's loopback (a node's own address
    is routed through ``lo``: fast, unlimited); ranks of different nodes through the veth.
    """

    nodes = 2
    ADDRS = ("10.77.0.1", "10.77.0.2")

    def __init__(self, bandwidth: Optional[str], latency: Optional[str]) -> None:
        self.bandwidth, self.latency, self.ns, self.names = bandwidth, latency, None, []
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
            raise SystemExit("bench: --regime two-node needs root and iproute2 (ip, tc): it builds two "
                             "network namespaces joined by a rate-limited link")
        base = f"lcb{os.getpid()}"
        self.names = [f"{base}-n0", f"{base}-n1"]
        self.ns = self.names[0]
        try:
            for n in self.names:
                self._ip("netns", "add", n)
                self._ip("-n", n, "link", "set", "lo", "up")
            self._ip("link", "add", "lcb0", "netns", self.names[0], "type", "veth", "peer", "name", "lcb1",
                     "netns", self.names[1])
            for i, n in enumerate(self.names):
                self._ip("-n", n, "addr", "add", f"{self.ADDRS[i]}/24", "dev", f"lcb{i}")
                self._ip("-n", n, "link", "set", f"lcb{i}", "up")
                parent = ["root"]
                if latency:
                    subprocess.run(["tc", "-n", n, "qdisc", "add", "dev", f"lcb{i}", "root", "handle", "1:",
                                    "netem", "delay", latency], check=True)
                    parent = ["parent", "1:"]
                if bandwidth:
                    subprocess.run(["tc", "-n", n, "qdisc", "add", "dev", f"lcb{i}", *parent, "handle", "2:",
                                    "tbf", "rate", bandwidth, "burst", "256kb", "latency", "100ms"], check=True)
        except subprocess.CalledProcessError as err:
            self.close()
            raise SystemExit(f"bench: could not set up the two-node link ({' '.join(err.cmd)} failed)")

    def prefix(self, node: int = 0) -> List[str]:
        return ["ip", "netns", "exec", self.names[node]]

    def node_env(self, node: int) -> dict:
        # gloo binds to the veth address: same-node peers are reached through lo, others the veth.
        return {"GLOO_SOCKET_IFNAME": f"lcb{node}", "MASTER_ADDR": self.ADDRS[0]}

    def counters(self) -> Optional[int]:
        total = 0
        for i, n in enumerate(self.names):
            out = subprocess.run(["ip", "netns", "exec", n, "cat", f"/sys/class/net/lcb{i}/statistics/tx_bytes"],
                                 check=True, capture_output=True, text=True).stdout
            total += int(out)
        return total

    def close(self) -> None:
        for n in self.names:
            subprocess.run(["ip", "netns", "del", n], check=False)
        self.names, self.ns = [], None
