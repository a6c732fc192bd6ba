"""The examples run as the docs show them (on the simulation, both roles in
this process)."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_the_kv_cache_example(capsys) -> None:
    module = runpy.run_path(str(EXAMPLES / "kv_cache.py"))
    module["main"](["both", "--backend", "sim"])
    assert "128 blocks of 16384 bytes read in one batch and checked" in capsys.readouterr().out
