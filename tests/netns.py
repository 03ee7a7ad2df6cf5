"""Hosts for multi-node tests and benchmarks on one machine: each a Linux network namespace with its own
address on a bridge, mpirun's remote launch going through `ip netns exec` (the rsh agent) instead of ssh
(docs/multinode.md). Needs root (CAP_NET_ADMIN) and iproute2: `unavailable()` says why not."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("mpirun"):
        return "network namespaces need root, iproute2 and Open MPI"
    probe = f"lmiprobe{os.getpid() % 100000}"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return "this machine cannot make network namespaces (no CAP_NET_ADMIN)"
    _ip("netns", "del", probe, check=False)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Hosts:
    """`count` namespaces on one bridge: host i is 10.<net>.<sub>.<i+1>, the bridge .254; `hostfile`
    lists them (one slot each), `agent` is mpirun's rsh agent into them."""

    def __init__(self, tmp: Path, count: int):
        tag = os.getpid() % 100000
        self.bridge = f"lmib{tag}"
        self.names = [f"lmi{tag}h{i}" for i in range(count)]
        self.veths = [f"lmiv{tag}h{i}" for i in range(count)]
        self.subnet = f"10.213.{tag % 250}"
        self.addrs = [f"{self.subnet}.{i + 1}" for i in range(count)]
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name, veth, addr in zip(self.names, self.veths, self.addrs):
            _ip("netns", "add", name)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("netns", "exec", name, "ip", "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("netns", "exec", name, "ip", "link", "set", "eth0", "up")
            _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        self.hostfile = tmp / "hostfile"
        self.hostfile.write_text("".join(f"{a} slots=1\n" for a in self.addrs))
        # each host its own temporary directory, as real hosts have: the namespaces share this machine's
        # /tmp and hostname, where Open MPI's daemons of one job (and of a job just ended) would share
        # session directories and race to make and remove them
        self.tmpdirs = [tmp / f"host{i}-tmp" for i in range(count)]
        for d in self.tmpdirs:
            d.mkdir()
        self.agent = tmp / "netns-rsh"
        cases = "".join(f"  {a}) ns={n}; dir={d} ;;\n" for a, n, d in zip(self.addrs, self.names, self.tmpdirs))
        self.agent.write_text(f'#!/bin/sh\nhost="$1"; shift\ncase "$host" in\n{cases}  *) echo "unknown host $host" '
                              '>&2; exit 1 ;;\nesac\nexec ip netns exec "$ns" env TMPDIR="$dir" '
                              'OMPI_MCA_orte_tmpdir_base="$dir" sh -c "$*"\n')
        self.agent.chmod(0o755)

    def properties(self) -> str:
        """The multi-node keys that put an engine=MPI job's ranks on these hosts."""
        return (f"option.mpi_hostfile={self.hostfile}\noption.mpi_rsh_agent={self.agent}\n"
                f"option.mpi_network={self.subnet}.0/24\n")

    def link(self, host: int, up: bool) -> None:
        _ip("link", "set", self.veths[host], "up" if up else "down")

    def kill_leftovers(self) -> None:
        """Ranks in a host cut off from mpirun outlive it (as on a real worker host): end them."""
        for name in self.names:
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass

    def remove(self) -> None:
        self.kill_leftovers()
        for name, veth in zip(self.names, self.veths):
            _ip("netns", "del", name, check=False)
            _ip("link", "del", veth, check=False)  # (gone with its namespace, unless a process still holds it)
        _ip("link", "del", self.bridge, check=False)
