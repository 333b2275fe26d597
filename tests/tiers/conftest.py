"""Fixtures of the tier tests."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.mooncake_master import MooncakeMaster


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    """A real mooncake_master and its metadata server, on loopback only (tests/mooncake_master.py)."""
    m = MooncakeMaster().start()
    yield m
    m.close()
