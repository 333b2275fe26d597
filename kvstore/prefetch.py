"""Prefetch: promote SSD blocks into the host pool ahead of the get that will want them (PBKV §4.3, conservative).

Only into free host space: a prefetch never evicts, so it never displaces a pinned or recently used block. Requests
go through a bounded queue (`ssd.prefetch_queue` keys); a request that does not fit is refused at once with `busy`
and queues nothing. One worker thread reads the blocks with the same promotion path as a get (the disk read runs
without the state lock), and a get that meets a block still in flight waits for it instead of reading it twice.
A delete that races a prefetch wins: the block is never published.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.index import Holdings, Namespace
from kvstore.protocol import Code, ProtocolError

if TYPE_CHECKING:
    from kvstore.ops import State


@dataclass
class Ticket:
    """One prefetch request's progress: queued = done + skipped + pending."""
    queued: int
    done: int = 0
    skipped: int = 0

    @property
    def pending(self) -> int:
        return self.queued - self.done - self.skipped


class Prefetcher:
    def __init__(self, state: State, limit: int) -> None:
        self.state = state
        self.limit = limit
        self.queue: deque[tuple[Namespace, bytes, Ticket]] = deque()
        self.holder = Holdings()                # the prefetcher's own reservations
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvstore-prefetch", daemon=True)
        self._thread.start()

    def submit(self, ns: Namespace, hashes: list[bytes]) -> Ticket:
        """(Under the state lock.) Queue the keys, or refuse them all with `busy` if they do not fit."""
        if len(self.queue) + len(hashes) > self.limit:
            self.state.index.counters["prefetch_busy"] += 1
            raise ProtocolError(Code.BUSY, f"prefetch: the queue holds {len(self.queue)} of {self.limit} keys; "
                                           f"{len(hashes)} more do not fit, try again later")
        ticket = Ticket(len(hashes))
        self.holder.namespaces.add(ns.id)
        self.queue.extend((ns, h, ticket) for h in hashes)
        self.state.changed.notify_all()
        return ticket

    def _run(self) -> None:
        st = self.state
        with st.lock:
            while not self._stop:
                if not self.queue:
                    st.changed.wait()
                    continue
                ns, h, ticket = self.queue.popleft()
                ok = self._one(ns, h)
                ticket.done += ok
                ticket.skipped += not ok
                st.index.counters["prefetched" if ok else "prefetch_skipped"] += 1
                st.changed.notify_all()

    def _one(self, ns: Namespace, h: bytes) -> bool:
        """(Under the state lock, released during the read.) Promote one block into a free slot, unpinned."""
        st, idx = self.state, self.state.index
        plan = idx.plan_promotion(ns, [h], self.holder, evict=False)
        if not plan or idx.ssd is None:
            return False
        view = st.pool.view(plan[0][1])
        st.lock.release()
        try:
            n = idx.ssd.read([ns.digest + h], [view])
        except OSError:
            n = 0
        finally:
            view.release()
            st.lock.acquire()
        return bool(idx.finish_promotion(ns, plan, n, self.holder, pin=False))

    def queued(self) -> int:
        return len(self.queue)

    def close(self) -> None:
        with self.state.lock:
            self._stop = True
            self.state.changed.notify_all()
        self._thread.join(timeout=5)
