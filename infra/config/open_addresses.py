"""How many addresses a list of CIDRs opens, and how many is too many for an allow-list.

The EKS API endpoint's check counts rather than matching `0.0.0.0/0`: `0.0.0.0/1` and `128.0.0.0/1`
together are the same internet. The policy pack draws the same line (policy/rules/api_endpoint.py, a
program of its own that cannot import this; a test holds the two to the same answers).
"""

from __future__ import annotations

import ipaddress
from typing import Iterable

OPEN_ADDRESS_LIMITS = {4: 2**24, 6: 2**96}
"""The most addresses, per IP version, an allow-list may open: a /8's worth of IPv4 (the largest
block ever assigned to a single organisation, the legacy class A networks) and a /32's worth of IPv6
(what a regional registry allocates to a whole ISP; one site gets a /48). A list that opens more is
many organisations' networks at once, a slice of the internet rather than anyone's own range."""
LIMIT_NAMES = {4: "a /8's worth", 6: "a /32's worth"}


def addresses_opened(cidrs: Iterable[str]) -> dict[int, int]:
    """IP version -> how many addresses the CIDRs open together (an address in two CIDRs once).
    Each CIDR must parse (host bits allowed)."""
    networks = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    return {version: sum(n.num_addresses for n in ipaddress.collapse_addresses(
                [n for n in networks if n.version == version]))
            for version in sorted({n.version for n in networks})}
