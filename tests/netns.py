"""Linux network namespaces for the network-fault tests: a veth pair, partitions, netem (no pytest import).

``Namespace()`` makes a namespace ``jnf<pid>n<i>`` and a veth pair to the root namespace on a /30 of
10.213.0.0/16 that no interface of this machine uses: ``host_ip`` (root side, where redis-server and the
S3 endpoint listen) and ``ns_ip`` (inside). ``exec_args(argv)`` runs a process inside (``ip netns exec``).

``partition(port)`` drops, silently, every TCP segment between the namespace and ``host_ip:port`` with
iptables rules inside the namespace (a real partition: no RST, no ICMP; the peers' TCP stacks retransmit
into the void); ``heal()`` removes them. Without iptables (or netfilter in the kernel), ``partition()``
takes the namespace's veth end down instead, which cuts every port. ``netem(...)`` puts a ``tc netem``
qdisc on both veth ends (raises ``NetemUnavailable`` where the kernel has no ``sch_netem``).

Cleanup: ``close()`` (idempotent, also run at interpreter exit) deletes the veth pair and the namespace;
namespaces left by a killed test run (their pid is gone) are deleted by the next ``Namespace()``.

``unavailable_reason()`` says why namespaces cannot be made here (not Linux, not root, no ``ip``, the
kernel refuses), or None; the tests skip loudly with it.
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import itertools
import os
import random
import re
import shutil
import subprocess
import sys

PREFIX = "jnf"
_counter = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip``/``tc``/``iptables`` command failed; the message carries the command and its stderr."""


class NetemUnavailable(NetnsError):
    """``tc qdisc ... netem`` is refused: the kernel has no ``sch_netem`` (or ``tc`` is missing)."""


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command (``ip``, ``tc``, ``iptables``); ``NetnsError`` naming it and its stderr when it fails."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why this process cannot make network namespaces with a veth pair (None: it can). Makes one and removes it."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"network namespaces need root (CAP_NET_ADMIN); this test runs as uid {os.geteuid()}"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed: apt-get install iproute2"
    try:
        probe = Namespace()
    except NetnsError as err:
        return f"the kernel or permissions refuse a network namespace with a veth pair: {err}"
    probe.close()
    return None


@functools.lru_cache(maxsize=1)
def netem_unavailable_reason() -> str | None:
    """Why ``tc qdisc ... netem`` cannot be used here (None: it can); needs ``unavailable_reason()`` None."""
    if shutil.which("tc") is None:
        return "the 'tc' command (iproute2) is not installed"
    probe = Namespace()
    try:
        probe.netem(delay_ms=1)
    except NetemUnavailable as err:
        return str(err)
    finally:
        probe.close()
    return None


def partition_tool() -> str:
    """``iptables`` (silent drops of one port) when usable here, else ``link`` (the veth end taken down)."""
    return "iptables" if _iptables_works() else "link"


@functools.lru_cache(maxsize=1)
def _iptables_works() -> bool:
    if shutil.which("iptables") is None:
        return False
    probe = Namespace()
    try:
        return probe.run_inside("iptables", "-w", "-L", "-n", check=False).returncode == 0
    finally:
        probe.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Delete the namespaces and veth ends of earlier runs whose process is gone (a killed pytest)."""
    names = [line.split()[0] for line in run("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()]
    links = re.findall(r"^\d+: ([^:@]+)", run("ip", "-o", "link", "show", check=False).stdout, flags=re.M)
    for name in names + links:
        m = re.fullmatch(rf"{PREFIX}(\d+)[nh]\d+", name)
        if m and not _pid_alive(int(m.group(1))):
            if name in names:
                run("ip", "netns", "delete", name, check=False)
            else:
                run("ip", "link", "delete", name, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 of 10.213.0.0/16 that overlaps no address or route of the root namespace."""
    used = [ipaddress.ip_network(n, strict=False)
            for n in re.findall(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", run("ip", "-4", "-o", "addr", check=False).stdout)]
    used += [ipaddress.ip_network(n, strict=False)
             for n in re.findall(r"^(\d+\.\d+\.\d+\.\d+/\d+)", run("ip", "-4", "route", check=False).stdout, re.M)]
    for _ in range(200):
        net = ipaddress.ip_network(f"10.213.{random.randrange(256)}.{4 * random.randrange(64)}/30")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError("no free /30 in 10.213.0.0/16 for a veth pair")


class Namespace:
    """A network namespace joined to the root namespace by a veth pair; ``close()`` removes both."""

    def __init__(self) -> None:
        remove_stale()
        i = next(_counter)
        self.name = f"{PREFIX}{os.getpid()}n{i}"
        self.host_if, self.ns_if = f"{PREFIX}{os.getpid()}h{i}", f"{PREFIX}{os.getpid()}p{i}"
        net = _free_subnet()
        host, inside = list(net.hosts())
        self.host_ip, self.ns_ip, self.prefixlen = str(host), str(inside), net.prefixlen
        self._rules: list[list[str]] = []
        self._closed = False
        atexit.register(self.close)
        try:
            run("ip", "netns", "add", self.name)
            run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            run("ip", "link", "set", self.ns_if, "netns", self.name)
            run("ip", "addr", "add", f"{self.host_ip}/{self.prefixlen}", "dev", self.host_if)
            run("ip", "link", "set", self.host_if, "up")
            self.run_inside("ip", "addr", "add", f"{self.ns_ip}/{self.prefixlen}", "dev", self.ns_if)
            self.run_inside("ip", "link", "set", self.ns_if, "up")
            self.run_inside("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def exec_args(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: the pid is the program's)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run_inside(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(*self.exec_args(list(argv)), check=check)

    @property
    def partitioned(self) -> bool:
        return bool(self._rules)

    def partition(self, port: int) -> str:
        """Drop every TCP segment to and from ``host_ip:port`` (iptables inside the namespace), or take the
        veth end down where iptables is unusable (every port); returns how (``iptables`` or ``link``)."""
        if partition_tool() == "iptables":
            for rule in (["OUTPUT", "-p", "tcp", "-d", self.host_ip, "--dport", str(port), "-j", "DROP"],
                         ["INPUT", "-p", "tcp", "-s", self.host_ip, "--sport", str(port), "-j", "DROP"]):
                self.run_inside("iptables", "-w", "-I", *rule)
                self._rules.append(rule)
            return "iptables"
        self.run_inside("ip", "link", "set", self.ns_if, "down")
        self._rules.append(["link"])
        return "link"

    def heal(self) -> None:
        """Undo ``partition()``."""
        for rule in reversed(self._rules):
            if rule == ["link"]:
                self.run_inside("ip", "link", "set", self.ns_if, "up")
            else:
                self.run_inside("iptables", "-w", "-D", *rule)
        self._rules = []

    def netem(self, *, delay_ms: int = 0, loss_pct: float = 0.0) -> None:
        """``tc qdisc add ... netem`` on both veth ends: ``delay_ms`` each way is half of it (a round trip gains
        ``delay_ms``), ``loss_pct`` on the namespace's egress. Raises ``NetemUnavailable``."""
        for inside, dev, args in ((False, self.host_if, ["delay", f"{delay_ms / 2:g}ms"]),
                                  (True, self.ns_if, ["delay", f"{delay_ms / 2:g}ms", "loss", f"{loss_pct:g}%"])):
            argv = ["tc", "qdisc", "add", "dev", dev, "root", "netem", *args]
            proc = self.run_inside(*argv, check=False) if inside else run(*argv, check=False)
            if proc.returncode != 0:
                text = (proc.stderr or proc.stdout).strip()
                if "unknown" in text.lower() or "no such file" in text.lower():
                    raise NetemUnavailable(f"tc netem: {text} (the kernel has no sch_netem module)")
                raise NetnsError(f"{' '.join(argv)}: {text}")

    def close(self) -> None:
        """Remove the veth pair and the namespace (processes still inside keep running, cut off); idempotent."""
        if self._closed:
            return
        self._closed = True
        run("ip", "link", "delete", self.host_if, check=False)
        run("ip", "netns", "delete", self.name, check=False)

    def __enter__(self) -> Namespace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
