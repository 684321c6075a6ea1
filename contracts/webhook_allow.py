"""Where webhooks may go: the operator's allowlist ``JACOBIAN_WEBHOOK_ALLOW`` of hosts and networks.

Entries are host names (``hooks.example.com``), wildcard domains (``*.example.com``: its sub-domains),
IP addresses and CIDR networks (``10.0.0.0/8``, ``2001:db8::/32``). A URL is allowed when its host is a
listed name, or an address (literal, or every address its name resolves to) inside a listed network.
Link-local and cloud metadata addresses (``BLOCKED``) are refused whatever the list says, unless an entry
names an address or network inside them itself (``169.254.10.1``): ``0.0.0.0/0`` does not open them.
An empty list turns webhooks off. Addresses are checked again at each delivery, after DNS resolution, and
the connection goes to the address checked (no second lookup a rebinding name could answer otherwise).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
SETTING = "JACOBIAN_WEBHOOK_ALLOW"

BLOCKED: tuple[Network, ...] = tuple(ipaddress.ip_network(n) for n in (
    "169.254.0.0/16",      # IPv4 link-local: AWS, GCP, Azure, Oracle, DigitalOcean metadata at 169.254.169.254
    "fe80::/10",           # IPv6 link-local
    "fd00:ec2::254/128",   # AWS metadata over IPv6
    "100.100.100.200/32",  # Alibaba Cloud metadata
    "0.0.0.0/8",           # "this host": connecting to 0.0.0.0 reaches the local machine
    "::/128",
    "224.0.0.0/4",         # multicast
    "ff00::/8",
    "255.255.255.255/32",  # broadcast
))


class WebhookRefused(ValueError):
    """A webhook URL or address the allowlist does not allow; the message names the setting and the fix."""


def _address(text: str) -> Address | None:
    """``text`` as an IP address (an IPv4-mapped IPv6 address as its IPv4 address), None for a name."""
    try:
        addr = ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _blocked(addr: Address) -> Network | None:
    return next((net for net in BLOCKED if addr.version == net.version and addr in net), None)


@dataclass(frozen=True)
class WebhookAllow:
    """The parsed allowlist: exact host names, wildcard domain suffixes (``.example.com``) and networks."""

    hosts: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()
    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> WebhookAllow:
        """From the setting's entries; ``ValueError`` naming the setting and the entry for a malformed one."""
        hosts: set[str] = set()
        suffixes: list[str] = []
        networks: list[Network] = []
        for raw in entries:
            entry = raw.strip().lower().rstrip(".")
            if not entry:
                continue
            if "/" in entry or _address(entry) is not None:
                try:
                    networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                except ValueError:
                    raise ValueError(f"{SETTING}: {raw!r} is not an IP address or CIDR network; write e.g. "
                                     "10.0.0.0/8 or 2001:db8::/32") from None
            elif entry.startswith("*."):
                suffixes.append(entry[1:])
            elif "*" in entry or ":" in entry or not all(part for part in entry.split(".")):
                raise ValueError(f"{SETTING}: {raw!r} is not a host name; write hooks.example.com, *.example.com "
                                 "(its sub-domains), an IP address or a CIDR network")
            else:
                hosts.add(entry)
        return cls(frozenset(hosts), tuple(suffixes), tuple(networks))

    @property
    def is_empty(self) -> bool:
        """No entries: webhooks are off."""
        return not (self.hosts or self.suffixes or self.networks)

    def names(self, host: str) -> bool:
        """Whether ``host`` (a name) is listed, exactly or under a wildcard domain."""
        host = host.lower().rstrip(".")
        return host in self.hosts or any(host.endswith(suffix) for suffix in self.suffixes)

    def check_address(self, addr: Address, *, host: str, by_name: bool) -> None:
        """Refuse (``WebhookRefused``) an address of ``host``: a blocked one not listed itself, or, for a host
        not listed by name (``by_name``), one outside every listed network."""
        blocked = _blocked(addr)
        listed = [net for net in self.networks if net.version == addr.version and addr in net]
        if blocked is not None:
            if not any(net.subnet_of(blocked) for net in listed):  # type: ignore[arg-type]
                raise WebhookRefused(f"notify.url: {host!r} is {addr}, a link-local or metadata address "
                                     f"({blocked}), which webhooks never reach; give a public or listed host "
                                     f"(an operator may list that very address in {SETTING})")
            return
        if not by_name and not listed:
            raise WebhookRefused(f"notify.url: {host!r} is {addr}, outside the networks allowed for webhooks; "
                                 f"use an allowed host, or ask an operator to add it to {SETTING}")

    def check_addresses(self, host: str, addresses: Sequence[Address]) -> None:
        """Every address ``host`` resolved to must be allowed (``check_address``); none at all is refused."""
        if not addresses:
            raise WebhookRefused(f"notify.url: {host!r} resolves to no address; give a host that resolves")
        by_name = _address(host) is None and self.names(host)
        for addr in addresses:
            self.check_address(addr, host=host, by_name=by_name)

    def check_url(self, url: str, *, resolve: bool = True) -> None:
        """At POST: refuse a URL whose host is neither a listed name nor (its addresses) in a listed network.

        A listed name is not resolved here (its addresses are checked at each delivery); an unlisted name is
        resolved when ``resolve`` and networks are listed, and allowed when all its addresses are."""
        if self.is_empty:
            raise WebhookRefused(f"notify: webhooks are off on this service ({SETTING} is empty); remove "
                                 f"notify, or ask an operator to list the receiver's host in {SETTING}")
        host = urlsplit(url).hostname or ""
        literal = _address(host)
        if literal is not None:
            self.check_address(literal, host=host, by_name=False)
            return
        if self.names(host):
            return
        if not self.networks or not resolve:
            raise WebhookRefused(f"notify.url: host {host!r} is not allowed for webhooks; use a host listed in "
                                 f"{SETTING} or ask an operator to add it")
        try:
            addresses = resolve_host(host, urlsplit(url).port or 443)
        except OSError:
            raise WebhookRefused(f"notify.url: host {host!r} is not listed in {SETTING} and does not resolve; "
                                 "give a listed or resolvable host") from None
        self.check_addresses(host, addresses)


def resolve_host(host: str, port: int) -> list[Address]:
    """The addresses of ``host`` (a literal is itself), in the resolver's order, without duplicates.
    Raises ``OSError`` (``socket.gaierror``) when it does not resolve."""
    literal = _address(host)
    if literal is not None:
        return [literal]
    found: list[Address] = []
    for _family, _type, _proto, _name, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        addr = _address(str(sockaddr[0]))
        if addr is not None and addr not in found:
            found.append(addr)
    return found
