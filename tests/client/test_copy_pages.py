"""The connector's layer move (kvstore.checksum.copy_pages, native/kvcopy.c copy_pages) and its fallback: every run
of every block lands where the slot layout says, a block's CRC-32C continued layer by layer over its runs is the CRC
of its whole slot (what a save commits and a load checks, without a second pass), both directions, and a bad offset,
slot or size is refused before any byte moves."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvstore import checksum
from kvstore.checksum import crc32c

try:
    from kvstore._kvcopy import HARDWARE
except ImportError:
    HARDWARE = False

KINDS = ["native", "fallback"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        if not HARDWARE:
            pytest.skip("kvstore._kvcopy not built or no CRC-32C instruction")
    else:
        monkeypatch.setattr(checksum, "_kvcopy", None)
    return str(request.param)


def _layout(rng: np.random.Generator, blocks: int, layers: int, runs: int, run: int
            ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """An engine's storage with `blocks` pages per layer scattered in it, and per layer the run offsets."""
    pages = rng.integers(0, 256, size=blocks * layers * runs * run * 3 + 13, dtype=np.uint8)
    starts = rng.permutation((pages.nbytes - run) // run)[: blocks * layers * runs] * run + rng.integers(0, 7)
    offsets = [starts[li * blocks * runs:(li + 1) * blocks * runs].astype(np.int64) for li in range(layers)]
    slots = [np.zeros(layers * runs * run + 5, np.uint8) for _ in range(blocks)]
    return pages, offsets, slots


@pytest.mark.parametrize("runs,run", [(1, 4096), (2, 1000), (3, 7), (1, 1 << 17)])
def test_a_block_moved_layer_by_layer_has_its_slot_crc_and_comes_back_byte_exact(kind: str, runs: int,
                                                                                  run: int) -> None:
    rng = np.random.default_rng(runs * run)
    blocks, layers = 5, 4
    pages, offsets, slots = _layout(rng, blocks, layers, runs, run)
    crcs = np.zeros(blocks, np.uint32)
    for li in range(layers):
        checksum.copy_pages(pages, offsets[li], slots, li * runs * run, run, crcs, to_slots=True, stream=li % 2 == 0)
    for b, slot in enumerate(slots):
        want = np.concatenate([pages[o:o + run] for li in range(layers)
                               for o in offsets[li][b * runs:(b + 1) * runs]])
        assert bytes(slot[:want.nbytes]) == want.tobytes()
        assert int(crcs[b]) == crc32c(slot[:want.nbytes])          # the CRC of the whole slot, in one pass
    back = np.zeros_like(pages)
    crcs2 = np.zeros(blocks, np.uint32)
    for li in range(layers):
        checksum.copy_pages(back, offsets[li], slots, li * runs * run, run, crcs2, to_slots=False)
    assert crcs2.tolist() == crcs.tolist()
    for li in range(layers):
        for o in offsets[li]:
            assert bytes(back[o:o + run]) == bytes(pages[o:o + run])
    back[:] = 0
    checksum.copy_pages(back, offsets[0], slots, 0, run, None, to_slots=False)    # without CRCs: plain copies
    assert all(bytes(back[o:o + run]) == bytes(pages[o:o + run]) for o in offsets[0])


def test_an_altered_slot_gives_another_crc(kind: str) -> None:
    rng = np.random.default_rng(3)
    pages, offsets, slots = _layout(rng, 3, 1, 1, 512)
    crcs = np.zeros(3, np.uint32)
    checksum.copy_pages(pages, offsets[0], slots, 0, 512, crcs, to_slots=True)
    slots[1][100] ^= 1
    got = np.zeros(3, np.uint32)
    checksum.copy_pages(np.zeros_like(pages), offsets[0], slots, 0, 512, got, to_slots=False)
    assert [int(g) == int(c) for g, c in zip(got, crcs)] == [True, False, True]


BAD: list[tuple[str, dict[str, Any]]] = [
    ("outside the pages", {"offsets": np.array([0, 1 << 20], np.int64)}),
    ("runs end at", {"run_bytes": 3000}),
    ("run offsets for 2 slots", {"offsets": np.array([0, 100, 200], np.int64)}),
    ("int64", {"offsets": np.array([0, 100], np.int32)}),
    ("at least 2 entries", {"crcs": np.zeros(1, np.uint32)}),
]


@pytest.mark.parametrize("message,change", BAD, ids=[m for m, _ in BAD])
def test_bad_arguments_are_refused_before_any_byte_moves(message: str, change: dict[str, Any]) -> None:
    if not HARDWARE:
        pytest.skip("the native checks")
    pages = np.arange(8192, dtype=np.uint8)
    slots = [np.zeros(2048, np.uint8), np.zeros(2048, np.uint8)]
    args: dict[str, Any] = {"offsets": np.array([0, 4096], np.int64), "run_bytes": 2048,
                            "crcs": np.zeros(2, np.uint32)}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        checksum.copy_pages(pages, args["offsets"], slots, 0, args["run_bytes"], args["crcs"], to_slots=True)
    assert not any(s.any() for s in slots)
    with pytest.raises(ValueError, match="overlaps the pages"):
        checksum.copy_pages(pages, np.array([0], np.int64), [pages[4096:]], 0, 2048, to_slots=True)
    with pytest.raises(ValueError, match="read-only"):
        checksum.copy_pages(np.frombuffer(bytes(8192), np.uint8), np.array([0], np.int64), slots[:1], 0, 2048,
                            to_slots=False)
