"""Multi-node for real on one machine: each "host" a Linux network namespace with its own address on a
bridge, mpirun's remote launch going through `ip netns exec` (the rsh agent) instead of ssh, the ranks
talking TCP over the bridge. Tensor parallelism 2 across two hosts gives HF's greedy tokens; a link
brought down turns into a 503 within 10 s and a stopped server, and a server started again once the
link is back serves (docs/multinode.md). Skipped where network namespaces cannot be made (not root,
no CAP_NET_ADMIN, no iproute2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
import requests

from tests.support import ids_of

HOSTS = 2


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Hosts:
    """HOSTS namespaces on one bridge: host i is 10.<net>.<sub>.<i+1>, the bridge .254."""

    def __init__(self, tmp):
        tag = os.getpid() % 100000
        self.bridge = f"lmib{tag}"
        self.names = [f"lmi{tag}h{i}" for i in range(HOSTS)]
        self.veths = [f"lmiv{tag}h{i}" for i in range(HOSTS)]
        self.subnet = f"10.213.{tag % 250}"
        self.addrs = [f"{self.subnet}.{i + 1}" for i in range(HOSTS)]
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
        self.agent = tmp / "netns-rsh"
        cases = "".join(f"  {a}) ns={n} ;;\n" for a, n in zip(self.addrs, self.names))
        self.agent.write_text(f'#!/bin/sh\nhost="$1"; shift\ncase "$host" in\n{cases}  *) echo "unknown host $host" '
                              '>&2; exit 1 ;;\nesac\nexec ip netns exec "$ns" sh -c "$*"\n')
        self.agent.chmod(0o755)

    def properties(self) -> str:
        return (f"engine=MPI\noption.tensor_parallel_degree={HOSTS}\noption.dtype=fp32\noption.kv_cache_memory=4MiB\n"
                f"option.mpi_hostfile={self.hostfile}\noption.mpi_rsh_agent={self.agent}\n"
                f"option.mpi_network={self.subnet}.0/24\noption.predict_timeout=5\n")

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


@pytest.fixture
def hosts(tmp_path):
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("mpirun"):
        pytest.skip("network namespaces need root, iproute2 and Open MPI")
    probe = f"lmiprobe{os.getpid() % 100000}"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        pytest.skip("this machine cannot make network namespaces (no CAP_NET_ADMIN)")
    _ip("netns", "del", probe, check=False)
    made = Hosts(tmp_path)
    yield made
    made.remove()


def test_tp2_across_two_hosts_matches_hf_and_a_link_down_is_a_503_then_a_restart_serves(hosts, hf, tiny_model,
                                                                                         start_server):
    server = start_server(hosts.properties(), tiny_model)
    prompt = "The river ran"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True}}
    assert ids_of(server.post(body).json()) == hf(prompt, 8)
    hosts.link(1, up=False)
    started = time.monotonic()
    stuck = requests.post(server.url + "/invocations", json=body, timeout=30)  # rank 1 cannot answer
    assert stuck.status_code == 424
    deadline = started + 10
    while requests.get(server.url + "/ping", timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "no 503 within 10 s of the link going down"
        time.sleep(0.1)
    assert server.proc.wait(timeout=30) != 0
    assert "exceeded option.predict_timeout=5 s (a rank, a device or the network between the ranks is stuck)" in \
        server.log()
    hosts.link(1, up=True)
    hosts.kill_leftovers()
    again = start_server(hosts.properties(), tiny_model)  # what the container's restart does
    assert ids_of(again.post(body).json()) == hf(prompt, 8)
