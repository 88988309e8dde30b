"""``--pace-mbit auto``: the UDP pacing rate from the link the peers are reached over.

Pacing exists so the unreliable channels do not burst past the port's rate into its
queues (docs/architecture.md, step 2). The right rate is the egress port's:

1. the route to a remote peer (``ip route get``, rtnetlink) names the egress device;
2. ``lo`` (every peer on this host): no line rate, so no pacing;
3. an HTB root on that device (a dgt tc profile, ``dgt testbed``): its top class's
   ceil, the rate the port actually drains at;
4. else the NIC's negotiated speed, ``/sys/class/net/<dev>/speed`` (Mbit/s; see the
   kernel's Documentation/ABI/testing/sysfs-class-net);
5. else 1000 Mbit/s, said so in the reason.

Netlink via pyroute2; never raises: a failed lookup falls back with its reason.
"""
from __future__ import annotations

import ipaddress
import logging

log = logging.getLogger(__name__)

FALLBACK_MBIT = 1000.0


def egress_device(dst: str) -> str:
    """Name of the device the kernel routes ``dst`` (an IP address) out of. Raises
    OSError/ValueError/LookupError when there is no route."""
    from pyroute2 import IPRoute
    with IPRoute() as ipr:
        routes = ipr.route("get", dst=str(ipaddress.ip_address(dst)))
        if not routes:
            raise LookupError(f"no route to {dst}")
        oif = routes[0].get_attr("RTA_OIF")
        links = ipr.link("get", index=oif)
        return links[0].get_attr("IFLA_IFNAME")


def htb_rate_mbit(dev: str) -> float | None:
    """The ceil of the top HTB class under ``dev``'s root qdisc, in Mbit/s, or None when
    the root is not HTB."""
    from .tc_profiles.applier import show
    state = show(dev)
    roots = [q for q in state["qdiscs"] if q["parent"] == "root" and q["kind"] == "htb"]
    if not roots:
        return None
    top = [c.get("ceil_bit") for c in state["classes"]
           if c["parent"] in ("root", roots[0]["handle"]) and c.get("ceil_bit")]
    return max(top) / 1e6 if top else None


def nic_speed_mbit(dev: str) -> float | None:
    """``/sys/class/net/<dev>/speed`` when positive, else None (virtual devices, link
    down)."""
    try:
        with open(f"/sys/class/net/{dev}/speed") as f:
            v = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return float(v) if v > 0 else None


def peers_on_loopback(peer_hosts: list[str]) -> bool:
    """True when the route to the peers (the first of ``peer_hosts``) leaves through
    ``lo``, or there are no peers: no line whose bytes a codec could save. False when
    the route is unknown (then the peers are taken to be across a link)."""
    if not peer_hosts:
        return True
    try:
        return egress_device(peer_hosts[0]) == "lo"
    except Exception:  # noqa: BLE001 - unknown route: assume a real link
        return False


def auto_pace_mbit(peer_hosts: list[str]) -> tuple[float, str]:
    """(pacing rate in Mbit/s, 0 = unpaced; the reason in words) for a node whose peers
    are at ``peer_hosts`` (IP addresses, this node's own excluded)."""
    if not peer_hosts:
        return 0.0, "no peers: unpaced"
    try:
        dev = egress_device(peer_hosts[0])
    except Exception as e:  # noqa: BLE001 - any lookup failure falls back, with why
        return FALLBACK_MBIT, f"route to {peer_hosts[0]} unknown ({e}): {FALLBACK_MBIT:g}"
    if dev == "lo":
        return 0.0, "peers on loopback: no line rate, unpaced"
    try:
        rate = htb_rate_mbit(dev)
    except Exception as e:  # noqa: BLE001
        log.debug("tc lookup on %s failed: %s", dev, e)
        rate = None
    if rate:
        return rate, f"HTB rate of {dev}"
    speed = nic_speed_mbit(dev)
    if speed:
        return speed, f"link speed of {dev}"
    return FALLBACK_MBIT, f"{dev} reports no speed: {FALLBACK_MBIT:g}"
