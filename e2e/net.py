"""Pod IPs that are local to this machine and acceptable to Kubernetes.

Loopback (127.0.0.0/8) would need no setup, but the apiserver rejects it in
EndpointSlices ("may not be in the loopback range"), so the endpointslice
controller could never publish a pod. Instead pods get addresses from the
RFC 2544 benchmarking range 198.18.0.0/15, made local with one "AnyIP" route:

    ip route add local 198.18.0.0/15 dev lo

after which every address in it is bindable and reachable on this machine,
just like 127.x. Adding the route needs CAP_NET_ADMIN (root in CI); it is
left in place (harmless, and a concurrent cluster may rely on it). Remove it
with `ip route del local 198.18.0.0/15 dev lo`.
"""

from __future__ import annotations

import ipaddress
import random
import socket
import subprocess

POD_SUPERNET = ipaddress.ip_network("198.18.0.0/15")
#: where pods go when the route cannot be added: runs, but no EndpointSlices
LOOPBACK_FALLBACK = ipaddress.ip_network("127.0.0.0/8")


def bindable(ip: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((ip, 0))
        except OSError:
            return False
    return True


def ensure_pod_route() -> str | None:
    """Make POD_SUPERNET local if it is not yet; None if that worked, else why not."""
    probe = str(POD_SUPERNET.network_address + 1)
    if bindable(probe):
        return None
    try:
        out = subprocess.run(
            ["ip", "route", "add", "local", str(POD_SUPERNET), "dev", "lo"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run `ip route add`: {exc}"
    if bindable(probe):
        return None
    return f"`ip route add local {POD_SUPERNET} dev lo` failed: {out.stderr.strip() or out.returncode}"


def pick_pod_cidr(local_route: bool) -> str:
    """A random /24 per cluster, so two clusters side by side do not share pod IPs."""
    parent = POD_SUPERNET if local_route else LOOPBACK_FALLBACK
    # 127.0.0.0/24 holds 127.0.0.1, where the control plane listens.
    subnets = [s for s in parent.subnets(new_prefix=24) if s != ipaddress.ip_network("127.0.0.0/24")]
    return str(random.choice(subnets))


def is_loopback(cidr: str) -> bool:
    return ipaddress.ip_network(cidr).subnet_of(LOOPBACK_FALLBACK)  # type: ignore[arg-type]
