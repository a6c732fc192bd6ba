"""Two processes on rdma-core: the KV-cache example's prefill and decode
workers as two Python processes over rxe0, in the SoftRoCE guest
(``scripts/python-tests.sh --rxe``, the CI stage ``python-rxe``: the guest boots with the
host's ``/``, so this virtual environment and the wheel in it run there
unchanged). Elsewhere these tests skip, saying why; with
``GDR_EXPECT_RXE=1`` (set in the guest) a missing RDMA device fails them
instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gdr

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "kv_cache.py"
WAIT = 60.0


def _rdma_or_skip() -> None:
    try:
        engine = gdr.Engine(backend="real")
    except gdr.GdrError as error:
        if os.environ.get("GDR_EXPECT_RXE") == "1":
            raise AssertionError(f"GDR_EXPECT_RXE=1 but no RDMA device: {error}") from error
        pytest.skip(f"no RDMA device here ({error}); runs in the SoftRoCE guest")
    engine.close()


def test_kv_cache_blocks_between_two_processes_over_rxe() -> None:
    _rdma_or_skip()
    prefill = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "prefill", "--backend", "real"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert prefill.stdout is not None
        line = prefill.stdout.readline()
        assert line.startswith("prefill: listening at "), line
        address = line.rsplit(" ", 1)[1].strip()
        decode = subprocess.run(
            [sys.executable, str(EXAMPLE), "decode", "--backend", "real", "--connect", address],
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
        assert decode.returncode == 0, decode.stdout + decode.stderr
        assert "128 blocks of 16384 bytes read in one batch and checked" in decode.stdout
        assert prefill.wait(WAIT) == 0, prefill.stdout.read()
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()


def test_the_engine_reports_rdma_core() -> None:
    _rdma_or_skip()
    engine = gdr.Engine(backend="real")
    verbs, _cuda, _notes = engine.backends()
    assert verbs == "rdma-core"
    assert engine.nics(), "rdma-core lists no NIC"
    report = engine.describe()
    assert report["rdma"], "the doctor sees no RDMA device"
