"""A KV-cache block transfer: a prefill worker holds a pool of fixed-size
KV blocks; a decode worker asks for some of them (not contiguous, in any
order) and READs them into blocks of its own pool, all in one batch.

Two processes on real RDMA (rdma-core: a NIC, or rxe in the SoftRoCE
guest)::

    python kv_cache.py prefill --backend real               # prints host:port
    python kv_cache.py decode --backend real --connect HOST:PORT

or both in this process on the simulation::

    python kv_cache.py both --backend sim

The block lists travel as numpy arrays (no Python loop per block); the pool
can be any registrable memory: a numpy array here, a torch or CuPy tensor
on the GPU as well.
"""

from __future__ import annotations

import argparse
import threading
from typing import Optional

import numpy as np

import gdr

BLOCK = 16 << 10  # bytes of one KV block (a layer's K and V for 16 tokens, say)
BLOCKS = 512  # blocks in each pool
WAIT = 30.0


def make_pool(seed: int) -> np.ndarray:
    """A pool whose block i holds bytes that name it."""
    pool = np.empty((BLOCKS, BLOCK), dtype=np.uint8)
    pool[:] = (np.arange(BLOCKS, dtype=np.uint64)[:, None] * 7 + seed) % 251
    return pool


def prefill(engine: gdr.Engine, ready: Optional[threading.Event] = None, out: Optional[list[tuple[str, int]]] = None) -> None:
    """Serves one decode worker: grants its pool for reading, answers which
    grant, waits for "done"."""
    pool = make_pool(seed=1)
    region = engine.register(pool)
    listener = engine.listen()
    print(f"prefill: listening at {listener.address[0]}:{listener.address[1]}", flush=True)
    if out is not None:
        out.append(listener.address)
    if ready is not None:
        ready.set()
    peer = listener.accept(WAIT)
    grant = peer.grant(region, rights="read")
    peer.send(grant.descriptor.to_bytes()).wait(WAIT)
    assert peer.recv(WAIT) == b"done"
    grant.revoke(WAIT)


def decode(engine: gdr.Engine, address: tuple[str, int]) -> None:
    """READs a scattered set of the prefill worker's blocks into its own
    pool in one batch, and checks them."""
    pool = np.zeros((BLOCKS, BLOCK), dtype=np.uint8)
    region = engine.register(pool)
    peer = engine.connect(address, WAIT)
    remote = gdr.Descriptor.from_bytes(peer.recv(WAIT))
    rng = np.random.default_rng(3)
    wanted = rng.choice(BLOCKS, size=128, replace=False).astype(np.uint64)  # their blocks
    slots = rng.choice(BLOCKS, size=128, replace=False).astype(np.uint64)  # ours
    peer.read(region, remote, local_offset=slots * BLOCK, remote_offset=wanted * BLOCK, length=BLOCK).wait(WAIT)
    theirs = make_pool(seed=1)
    for slot, block in zip(slots, wanted):
        assert np.array_equal(pool[int(slot)], theirs[int(block)]), f"block {block} in slot {slot}"
    peer.send(b"done").wait(WAIT)
    print(f"decode: {len(wanted)} blocks of {BLOCK} bytes read in one batch and checked", flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["prefill", "decode", "both"])
    parser.add_argument("--backend", default="auto", choices=["auto", "real", "sim"])
    parser.add_argument("--connect", help="HOST:PORT of the prefill worker (decode)")
    args = parser.parse_args(argv)
    if args.role == "prefill":
        prefill(gdr.Engine(backend=args.backend))
    elif args.role == "decode":
        if not args.connect:
            parser.error("decode needs --connect HOST:PORT")
        host, _, port = args.connect.rpartition(":")
        decode(gdr.Engine(backend=args.backend), (host, int(port)))
    else:
        ready = threading.Event()
        address: list[tuple[str, int]] = []
        server = threading.Thread(target=prefill, args=(gdr.Engine(backend=args.backend), ready, address))
        server.start()
        ready.wait(WAIT)
        decode(gdr.Engine(backend=args.backend), address[0])
        server.join()


if __name__ == "__main__":
    main()
