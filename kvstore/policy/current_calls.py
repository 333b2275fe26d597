"""What each workflow's current call read, for the workflow policy (kvstore.policy.workflow, .compact): the seam
between the order of a prefix and how a client saves it. Apart from workflow.py because it is its own mechanism
(bounded books of calls, not of blocks), shared by both forms of the policy."""
from __future__ import annotations

from collections import OrderedDict

from kvstore.workflows import Touch, Workflows


class CurrentCalls:
    """What each of the last CALLS calls touched (its workflow's latest call: read or stored with its context), for
    two things a put of only the missed blocks (`Namespace.put`, the SGLang backend) does not do as a whole-chain
    save does (kvstore.index.stores), though the order of a prefix needs them:
    - `mine`: the index keeps a put from evicting its own chain, but that put does not name the prefix it hit; the
      policy does not evict a block the calling request itself touched for a deeper block of it (`admits`).
    - `stale`: a whole-chain save refreshes the hit prefix after storing the rest, so the head ends up the most
      recent; a put of the missed blocks leaves the new tail more recent than the head it follows. The calls whose
      blocks were stored after their prefix was read are returned once, with that prefix (read order, head first):
      the policy refreshes it, tail first, before it next picks a victim.
    Bounded: CALLS calls, the least recent forgotten."""
    CALLS = 64

    def __init__(self, flows: Workflows) -> None:
        self.flows = flows
        self._calls: OrderedDict[str, tuple[int, dict[bytes, None]]] = OrderedDict()   # wid → (step, read keys)
        self._stale: dict[str, None] = {}

    def _call(self, touch: Touch | None) -> dict[bytes, None] | None:
        if touch is None:
            return None
        w = self.flows.active.get(touch.workflow)
        if w is None:
            return None
        got = self._calls.get(w.wid)
        if got is None or got[0] != w.steps:
            got = self._calls[w.wid] = (w.steps, {})
            self._stale.pop(w.wid, None)
            while len(self._calls) > self.CALLS:
                self._stale.pop(self._calls.popitem(last=False)[0], None)
        else:
            self._calls.move_to_end(w.wid)
        return got[1]

    def read(self, key: bytes, touch: Touch | None) -> None:
        """A block held already was read or stored again with `touch`."""
        keys = self._call(touch)
        if keys is None or touch is None:
            return
        if keys and key == next(iter(keys)):
            self._stale.pop(touch.workflow, None)       # the head refreshed after the rest: in prefix order
        keys[key] = None

    def stored(self, key: bytes, touch: Touch | None) -> None:
        """A block was stored with `touch`."""
        keys = self._call(touch)
        if keys and touch is not None:
            self._stale[touch.workflow] = None

    def mine(self, key: bytes, touch: Touch) -> bool:
        """Whether the current call of `touch`'s workflow read `key`."""
        w = self.flows.active.get(touch.workflow)
        got = self._calls.get(touch.workflow)
        return w is not None and got is not None and got[0] == w.steps and key in got[1]

    def stale(self) -> list[list[bytes]]:
        """The read prefixes to refresh (each head first), once."""
        if not self._stale:
            return []
        out = [list(self._calls[wid][1]) for wid in self._stale if wid in self._calls]
        self._stale.clear()
        return out


__all__ = ["CurrentCalls"]
