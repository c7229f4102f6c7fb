"""The EKS API endpoint: not open to the internet unless the stack says so.

"Open to the internet" is a count, not a spelling: `0.0.0.0/1` and `128.0.0.0/1` together are
`0.0.0.0/0`, and so, near enough, are a few hundred /8s. The rule counts the addresses the list of
CIDRs opens in each address family (overlaps once) and refuses more than one organisation's range:
OPEN_ADDRESS_LIMITS says how much that is and why.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Iterable, Mapping

from .resources import UNKNOWN, as_list, value_at


OPEN_TO_INTERNET_TAG = "ray-eks:api-open-to-internet"
"""A tag on the EKS cluster, valued "true", with which a stack says it means its API endpoint to be
open to every address (the program sets it from `ray-eks:apiOpenToInternet`; infra/cluster.py
spells the same key: the pack is a program of its own)."""

OPEN_ADDRESS_LIMITS = {4: 2**24, 6: 2**96}
"""The most addresses, per IP version, an allow-list may open: a /8's worth of IPv4 (the largest
block ever assigned to a single organisation, the legacy class A networks) and a /32's worth of IPv6
(what a regional registry allocates to a whole ISP; one site gets a /48). A list that opens more is
many organisations' networks at once, a slice of the internet rather than anyone's own range.
infra/config/open_addresses.py draws the same line for config validation."""
_LIMIT_NAMES = {4: "a /8's worth", 6: "a /32's worth"}


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _parsed(cidrs: Iterable[Any]) -> list[tuple[str, Network]]:
    """(CIDR, network) for each CIDR that parses, host bits allowed (the widest reading); EKS itself
    refuses the others, and an UNKNOWN is judged once it is known."""
    out = []
    for cidr in cidrs:
        if not isinstance(cidr, str):
            continue
        try:
            out.append((cidr, ipaddress.ip_network(cidr.strip(), strict=False)))
        except ValueError:
            continue
    return out


def count_by_version(networks: Iterable[Network]) -> dict[int, int]:
    """IP version -> how many addresses the networks hold together (an address in two of them once)."""
    networks = list(networks)
    return {version: sum(n.num_addresses for n in ipaddress.collapse_addresses(
                [n for n in networks if n.version == version]))
            for version in sorted({n.version for n in networks})}


def addresses_opened(cidrs: Iterable[Any]) -> dict[int, int]:
    """IP version -> how many addresses the CIDRs open together."""
    return count_by_version(n for _, n in _parsed(cidrs))


def without(network: Network, excepted: Iterable[Any]) -> list[Network]:
    """`network` less the CIDRs in `excepted` (a NetworkPolicy ipBlock's `except`)."""
    left = [network]
    for _, cut in _parsed(excepted):
        pieces: list[Network] = []
        for n in left:
            if n.version != cut.version or not n.overlaps(cut):
                pieces.append(n)
            elif cut.subnet_of(n):
                pieces.extend(n.address_exclude(cut))
        left = pieces
    return left


def beyond_limits(shown: Iterable[str], networks: Iterable[Network]) -> list[str]:
    """For each IP version in which `networks` hold more addresses than OPEN_ADDRESS_LIMITS allows:
    the CIDRs `shown` for it and how many addresses they open."""
    shown = list(shown)
    out = []
    for version, count in count_by_version(networks).items():
        if count <= OPEN_ADDRESS_LIMITS[version]:
            continue
        mine = [c for c, n in _parsed(shown) if n.version == version]
        out.append(f"{', '.join(mine)} ({_amount(count, version)}, more than {_LIMIT_NAMES[version]})")
    return out


def _amount(count: int, version: int) -> str:
    if version == 6:  # a 39-digit number says nothing; a power of two does
        exponent = count.bit_length() - 1
        return f"{'' if count == 2**exponent else 'over '}2^{exponent} IPv6 addresses"
    return f"{count:,} IPv4 addresses"


def too_open(cidrs: Iterable[Any]) -> list[str]:
    """beyond_limits of a list of CIDRs, showing those not inside another listed one."""
    parsed = _parsed(cidrs)
    shown = [c for c, n in parsed if not any(o != n and n.version == o.version and n.subnet_of(o)
                                            for _, o in parsed)]
    return beyond_limits(shown, [n for _, n in parsed])


def public_api_access_violations(props: Mapping[str, Any]) -> list[str]:
    """The public EKS API endpoint is not open to the internet (more addresses than
    OPEN_ADDRESS_LIMITS allows, in either IP version), unless the cluster carries
    OPEN_TO_INTERNET_TAG. The endpoint authenticates with IAM, but a Ray cluster executes whatever
    code it is sent: one stolen or leaked credential anywhere is then enough, and scanners find
    open endpoints within hours."""
    vpc = props.get("vpcConfig")
    public, cidrs = value_at(vpc, "endpointPublicAccess"), value_at(vpc, "publicAccessCidrs")
    if public is False or UNKNOWN in (vpc, public, cidrs):
        return []
    open_to = too_open(as_list(cidrs)) if as_list(cidrs) else ["0.0.0.0/0 (the default)"]
    tags = props.get("tags")
    if not open_to or tags is UNKNOWN or value_at(tags, OPEN_TO_INTERNET_TAG) == "true":
        return []
    return [f"the public EKS API endpoint accepts connections from {'; '.join(open_to)}: anyone "
            "on the internet may try a credential against the API of a cluster that runs whatever "
            "code its Ray jobs are sent. Set ray-eks:apiAccessCidrs to your own address or range, "
            "or leave it empty for a private endpoint (docs/SECURITY.md shows both); a stack that "
            "means it says so with ray-eks:apiOpenToInternet: true"]
