"""The rendezvous store of a job and what listens on the network.

What listens on the network, and who may talk to it (issue 15):

* Rank 0's rendezvous store listens on ``MASTER_ADDR`` only (127.0.0.1 for a job
  on one machine), never on every interface (:func:`bind_address`).
* Gloo's own sockets: when ``MASTER_ADDR`` is a loopback address, every rank is on
  this machine, and ``GLOO_SOCKET_IFNAME`` is set to the loopback interface
  unless the user set it (a multi-host ``bunsan run`` sets it to the interface
  that reaches rank 0).
* The store has no authentication. bunsan's own keys (abort, progress, peers)
  live under a prefix made of the job id and 128 random bits that rank 0 sends
  to the others over the process group, never through the store: whoever can
  reach the store cannot guess the abort key and end the job with it.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import secrets
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

__all__ = ["bind_address", "keep_gloo_on_loopback", "share_secret", "tcp_store"]


def bind_address(master_addr: str) -> tuple[socket.AddressFamily, str]:
    """The address rank 0's store listens on: ``master_addr`` itself, resolved. Pure but for DNS.

    Every rank connects to ``master_addr``, so that is the one address the store
    needs; listening on every interface would expose it to every network the
    host is on. Returns the address family and the numeric address.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0]
    return family, str(sockaddr[0])


def _listening_socket(master_addr: str, port: int, all_local: bool = True) -> int:
    """A socket listening on ``master_addr:port``, for TCPStore's ``master_listen_fd``.

    Falls back to every interface, with a warning, when ``master_addr`` is not an
    address of this host (a name that resolves to a NAT's address, say), or
    resolves here to a loopback address while ranks run on other hosts (Debian
    maps the host's own name to 127.0.1.1): the job must still start.
    """
    family, address = bind_address(master_addr)
    sock = socket.socket(family, socket.SOCK_STREAM)

    def bind_everywhere(why: str) -> None:
        print(
            f"[bunsan] rank 0: MASTER_ADDR={master_addr} {why}; the rendezvous store listens on every interface",
            file=sys.stderr,
            flush=True,
        )
        sock.bind(("::" if family == socket.AF_INET6 else "", port))

    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if not all_local and ipaddress.ip_address(address).is_loopback:
            bind_everywhere(f"is {address} here, which other hosts cannot reach")
        else:
            try:
                sock.bind((address, port))
            except OSError as err:
                if err.errno != errno.EADDRNOTAVAIL:
                    raise
                bind_everywhere(f"({address}) is not an address of this host")
        sock.listen(1024)
        return sock.detach()
    except BaseException:
        sock.close()
        raise


def tcp_store(
    addr: str, port: int, world_size: int, is_master: bool, timeout_s: float, all_local: bool = True
) -> dist.Store:
    """A TCPStore client of ``addr:port``, or its server on rank 0 (``is_master``), listening on ``addr`` only."""
    return dist.TCPStore(
        addr,
        port,
        world_size if is_master else None,
        is_master,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        # TCPStore alone listens on every interface; hand it a socket bound to addr.
        master_listen_fd=_listening_socket(addr, port, all_local) if is_master else None,
    )


def _is_loopback(master_addr: str) -> bool:
    try:
        return ipaddress.ip_address(bind_address(master_addr)[1]).is_loopback
    except (OSError, ValueError):
        return False


def _loopback_interface() -> str | None:
    """The name of the loopback interface (``lo`` on Linux), or None where it cannot be told."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    if "lo" in names:
        return "lo"
    return next((name for name in names if name.startswith("lo")), None)


def keep_gloo_on_loopback(master_addr: str) -> None:
    """A job whose store is on loopback runs on one machine: keep Gloo's sockets on loopback too.

    Gloo listens on the address the host name resolves to, often an external
    one. ``GLOO_SOCKET_IFNAME`` is read each time a Gloo group is made, so it stays
    set for the life of the process (and its children inherit it).
    """
    if "GLOO_SOCKET_IFNAME" in os.environ or not _is_loopback(master_addr):
        return
    interface = _loopback_interface()
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def share_secret() -> str:
    """128 random bits from rank 0, sent over the process group (not the store). Collective."""
    token = [secrets.token_hex(16) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return str(token[0])
