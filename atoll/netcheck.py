"""Why a HOST:PORT does not answer: the path below gRPC, step by step, as one line saying what to check.

`diagnose` resolves the name and opens a TCP connection, so a message can tell a typo from a stopped coordinator, a
firewall or a TLS mismatch. The node says it while it retries its first contact (`atoll.node.first_contact`);
`atoll status` and `atoll job` say it when their call found no coordinator.
"""

from __future__ import annotations

import socket
from datetime import timedelta


def diagnose(address: str, *, tls: bool, timeout: timedelta = timedelta(seconds=2)) -> str:
    """A line saying why HOST:PORT may not answer as a coordinator, and what to check."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    checks = (f"check the address and port (--coordinator {address}), that the coordinator runs there, that no "
              f"firewall between here and there drops that port, and TLS (--tls-ca exactly when the coordinator "
              f"runs with TLS)")
    if not host or not port_text.isdigit():
        return f"{address!r} is not HOST:PORT; give --coordinator as HOST:PORT"
    try:
        infos = socket.getaddrinfo(host, int(port_text), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"the host name {host!r} does not resolve ({e.strerror}); check the address (--coordinator)"
    try:
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout.total_seconds())
            s.connect(sockaddr)
    except ConnectionRefusedError:
        return (f"{host} refuses connections on port {port_text}: nothing listens there. Is the coordinator "
                f"running, and on that port (its --listen)?")
    except (socket.timeout, TimeoutError):
        return (f"no answer from {host}:{port_text} within {timeout.total_seconds():.0f}s: a firewall may drop the "
                f"packets, or the address is not the coordinator's; {checks}")
    except OSError as e:
        return f"cannot connect to {host}:{port_text} ({e.strerror or e}); {checks}"
    if tls:
        return (f"{address} accepts connections but the TLS handshake or the call failed: check that --tls-ca is "
                f"the coordinator's certificate authority, that the coordinator runs with TLS (not --insecure), and "
                f"the job token (with TLS it also vouches for this client's certificate)")
    return (f"{address} accepts connections but does not answer as an Atoll coordinator: if the coordinator runs "
            f"with TLS, pass --tls-ca; otherwise check that the port is the coordinator's")
