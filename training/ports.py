"""Whether the coordinator's TCP port is free on this machine, checked before ``jax.distributed`` starts.

Process 0 of a ``jax.distributed`` job runs the coordination service: a gRPC server listening on every address
of its machine at the coordinator's port. When something already listens there, JAX's runtime does not raise:
process 0 crashes (SIGSEGV) after its initialisation timeout. So the launcher and process 0 check the port
first and stop with one line (``port_taken_line``). Standard library only: ``scripts/launch_local.py`` imports
it without starting JAX.
"""

from __future__ import annotations

import errno
import socket


def port_in_use(port: int) -> bool:
    """Whether binding TCP ``port`` on all addresses of this machine fails with ``EADDRINUSE``.

    Binds (never listens) with ``SO_REUSEADDR`` as the gRPC server does, so a port whose earlier connections
    are only in TIME_WAIT counts as free, and one with a listening socket (on any address) counts as in use.
    Tries IPv6 ``::`` (dual stack, the address gRPC binds) and IPv4 ``0.0.0.0``.

    Args:
      port: 1 .. 65535.
    Returns:
      True when the port is taken; False when free (or when no address family could be tried).
    """
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
                continue  # e.g. EADDRNOTAVAIL for :: without IPv6: try the next family
    return False


def port_taken_line(port: int, how_to_choose: str) -> str:
    """The one line printed when the coordinator port is taken; ``how_to_choose`` says how to pick another."""
    return (
        f"coordinator port {port} is already in use on this machine (another program or an earlier run "
        f"listens there); {how_to_choose}"
    )
