"""Sizes the allocator refuses: an error the caller can catch, the process
alive (they were the Rust allocator's abort), and the engine usable after."""

from __future__ import annotations

import pytest

import gdr

HUGE = 1 << 46  # 64 TiB: past any machine's memory and swap


def test_the_class() -> None:
    assert issubclass(gdr.OutOfMemory, MemoryError)
    assert issubclass(gdr.OutOfMemory, gdr.GdrError)


@pytest.mark.parametrize("kind", ["host", "pinned"])
def test_a_size_the_allocator_refuses_is_a_memory_error(kind: str) -> None:
    engine = gdr.Engine(backend="sim")
    with pytest.raises(MemoryError, match="out of memory|OutOfMemory") as refused:
        engine.alloc(HUGE, kind)
    assert isinstance(refused.value, gdr.OutOfMemory)
    region = engine.alloc(4096, kind)
    region.write_bytes(b"\x07" * 4096)
    assert region.read_bytes() == b"\x07" * 4096
