"""Two engines on this process's simulated fabric, connected, and a grant of
the listening side's memory to the connecting side."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pytest

import gdr

WAIT = 10.0


@dataclass
class Pair:
    server: gdr.Engine
    client: gdr.Engine
    to_client: gdr.Peer  # the server's peer object
    to_server: gdr.Peer  # the client's


def connect(server: gdr.Engine, client: gdr.Engine) -> Pair:
    listener = server.listen()
    accepted: dict[str, Any] = {}

    def accept() -> None:
        try:
            accepted["peer"] = listener.accept(WAIT)
        except BaseException as error:  # surfaced below
            accepted["error"] = error

    thread = threading.Thread(target=accept)
    thread.start()
    to_server = client.connect(listener.address, WAIT)
    thread.join()
    if "error" in accepted:
        raise accepted["error"]
    return Pair(server, client, accepted["peer"], to_server)


@pytest.fixture
def pair() -> Iterator[Pair]:
    server = gdr.Engine(backend="sim")
    client = gdr.Engine(backend="sim")
    yield connect(server, client)


@pytest.fixture
def granted(pair: Pair) -> Iterator[tuple[Pair, np.ndarray, gdr.Grant, gdr.Descriptor]]:
    """The server's 1 MiB numpy array granted READ and WRITE to the client."""
    target = np.zeros(1 << 20, dtype=np.uint8)
    grant = pair.to_client.grant(pair.server.register(target), rights="read_write")
    remote = pair.to_server.wait_grant(grant.id, WAIT)
    yield pair, target, grant, remote
