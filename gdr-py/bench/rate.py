"""The Python package's request rate on the simulator, the same workload as
gdr-core's ``facade_rate`` example (``compare.sh`` runs both back to back):
two engines of this process's simulated fabric, a 1 MiB host region
granted, batches WRITEd one after another, each waited for. Shapes: one
4 KiB request (the per-call cost), 64 x 4 KiB (a KV cache's blocks, given as
numpy arrays), 1024 x 64 B (the per-descriptor cost of a long list), and the
64 x 4 KiB batch given as a Python list of tuples (``Peer.submit``).

    python rate.py [seconds]

prints one line per shape: ``python <shape> <batches/s> <requests/s> <us per batch>``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

import numpy as np

import gdr

WAIT = 10.0


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    server, client = gdr.Engine(backend="sim"), gdr.Engine(backend="sim")
    listener = server.listen()
    accepted: list[gdr.Peer] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept(WAIT)))
    thread.start()
    to_server = client.connect(listener.address, WAIT)
    thread.join()
    to_client = accepted[0]
    target = np.zeros(1 << 20, dtype=np.uint8)
    grant = to_client.grant(server.register(target), rights="write")
    remote = to_server.wait_grant(grant.id, WAIT)
    source = client.register(np.zeros(1 << 20, dtype=np.uint8))

    def arrays(count: int, size: int) -> Callable[[], Any]:
        local = np.arange(count, dtype=np.uint64) * size
        theirs = local[::-1].copy()
        return lambda: to_server.write(source, remote, local, theirs, size)

    def as_list(count: int, size: int) -> Callable[[], Any]:
        transfers = [(gdr.WRITE, source, i * size, remote, (count - 1 - i) * size, size) for i in range(count)]
        return lambda: to_server.submit(transfers)

    shapes: list[tuple[str, int, Callable[[], Any]]] = [
        ("1x4KiB", 1, lambda: to_server.write(source, remote, 0, 0, 4096)),
        ("64x4KiB", 64, arrays(64, 4096)),
        ("1024x64B", 1024, arrays(1024, 64)),
        ("64x4KiB-list", 64, as_list(64, 4096)),
    ]
    for shape, count, submit in shapes:
        for _ in range(100):
            submit().wait(WAIT)
        started = time.perf_counter()
        batches = 0
        while time.perf_counter() - started < seconds:
            submit().wait(WAIT)
            batches += 1
        elapsed = time.perf_counter() - started
        print(
            f"python {shape} {batches / elapsed:.0f} {batches * count / elapsed:.0f} "
            f"{elapsed * 1e6 / batches:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
