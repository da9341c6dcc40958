"""The elastic job's lighthouse: torchft's quorum server, run by ``bunsan run --min-np`` as a process of its own.

``python -m bunsan.elastic.lighthouse --min-np 2`` prints the address the workers use on its first line and
serves until SIGTERM or SIGINT; with ``--until-stdin-closes`` also until its stdin closes (the launcher holds
the other end, so the lighthouse ends with the launcher however the launcher ends).

The times, chosen for a job that must go on within seconds of losing a worker:

* ``heartbeat_timeout_ms`` (1,000; torchft's default 5,000): a worker silent this long is out of the next
  quorum. Workers beat every 100 ms, so a live one misses ten beats before it is dropped.
* ``join_timeout_ms`` (10,000): how long the first quorum waits for workers that beat but have not asked to
  join; later quorums with every member of the last one present form at once (torchft's fast quorum), and
  a worker that joins later is taken into the quorum after it.
* ``quorum_tick_ms`` (50): how often the lighthouse checks whether a quorum can form.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "serve"]

HEARTBEAT_TIMEOUT_MS = 1000
JOIN_TIMEOUT_MS = 10_000
QUORUM_TICK_MS = 50


def _server_class() -> Any:
    """torchft's ``LighthouseServer``, loaded from its Rust extension alone where possible: the ``torchft``
    package imports torch first (over a second on a small machine), which the lighthouse does not use, and
    the launcher starts the workers only once the lighthouse answers."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("torchft")  # finds the package without running its __init__
    found = glob.glob(os.path.join(os.path.dirname(spec.origin or ""), "_torchft*.so")) if spec else []
    if found:
        extension = importlib.util.spec_from_file_location("_torchft", found[0])
        if extension is not None and extension.loader is not None:
            module = importlib.util.module_from_spec(extension)
            extension.loader.exec_module(module)
            return module.LighthouseServer
    from torchft._torchft import LighthouseServer

    return LighthouseServer


def serve(bind: str, min_np: int) -> Any:
    """Start torchft's lighthouse on ``bind`` (``host:port``, port 0 for a free one); returns the server."""
    return _server_class()(
        bind=bind,
        min_replicas=min_np,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        quorum_tick_ms=QUORUM_TICK_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bunsan.elastic.lighthouse", description=__doc__.split("\n")[0])
    parser.add_argument("--min-np", type=int, required=True, help="a step commits only with this many workers")
    parser.add_argument("--bind", default="127.0.0.1:0", help="host:port to serve on; default %(default)s")
    parser.add_argument("--until-stdin-closes", action="store_true", help="also stop when stdin closes")
    args = parser.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at info
    server = serve(args.bind, args.min_np)
    port = str(server.address()).rsplit(":", 1)[1]  # torchft names the host; the workers use the bound address
    print(f"http://{args.bind.rsplit(':', 1)[0]}:{port}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())

    def wait_for_eof() -> None:
        sys.stdin.read()
        done.set()

    if args.until_stdin_closes:
        threading.Thread(target=wait_for_eof, daemon=True).start()
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
