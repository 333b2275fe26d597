"""Each tenant's host blocks under its own eviction policy (`tenants[].policy`, issue 17 part 3).

Eviction classes are per (tenant, block size) (kvstore.index.namespaces), and a class never evicts another's blocks:
a class that needs room evicts its own victim, or takes a whole segment from another class (kvstore.index.capacity).
So a policy can be chosen per tenant with no arbitration between policies: `PerTenantPolicy` routes every call to
the policy of the class's tenant — by class for `added` and `victim`, by the key's class (the key table's) for the
rest. One instance per policy name serves every tenant that chose it; a class is routed once and remembered.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore.policy import Admitting, Asking, Explaining, Refusing, Reporting, Retiring

if TYPE_CHECKING:
    from kvstore.index.keytable import KeyTable
    from kvstore.policy import EvictionPolicy
    from kvstore.workflows import Touch


class PerTenantPolicy:
    name = "per-tenant"

    def __init__(self, table: KeyTable, policies: dict[str, EvictionPolicy], chosen: dict[str, str], default: str,
                 tenant_of: Callable[[int], str]) -> None:
        self.table = table
        self.policies = policies          # policy name → the one instance of it
        self.chosen = chosen              # tenant → policy name (others: `default`)
        self.default = default
        self.tenant_of = tenant_of        # eviction class → its tenant
        self._routes: dict[int, EvictionPolicy] = {}

    def for_class(self, cls: int) -> EvictionPolicy:
        p = self._routes.get(cls)
        if p is None:
            p = self._routes[cls] = self.policies[self.chosen.get(self.tenant_of(cls), self.default)]
        return p

    def _for_key(self, key: bytes) -> EvictionPolicy | None:
        """The policy of a stored key's class; None for a key the table does not hold (a delete of a block that
        is not there: no policy has books of it)."""
        return self.for_class(self.table.cls_of(key)) if key in self.table else None

    def added(self, key: bytes, cls: int, touch: Touch | None = None) -> None:
        self.for_class(cls).added(key, cls, touch)

    def removed(self, key: bytes) -> None:
        if (p := self._for_key(key)) is not None:
            p.removed(key)

    def accessed(self, key: bytes, touch: Touch | None = None) -> None:
        if (p := self._for_key(key)) is not None:
            p.accessed(key, touch)

    def pinned(self, key: bytes) -> None:
        if (p := self._for_key(key)) is not None:
            p.pinned(key)

    def unpinned(self, key: bytes) -> None:
        if (p := self._for_key(key)) is not None:
            p.unpinned(key)

    def moved(self, key: bytes, src: int, dst: int) -> None:
        if (p := self._for_key(key)) is not None:
            p.moved(key, src, dst)

    def victim(self, cls: int) -> bytes | None:
        return self.for_class(cls).victim(cls)

    def retired_victim(self, cls: int) -> bytes | None:
        """The class's retired block to evict first (the workflow policy's; None under LRU)."""
        p = self.for_class(cls)
        return p.retired_victim(cls) if isinstance(p, Retiring) else None

    def admits(self, victim: bytes, touch: Touch | None, key: bytes | None = None) -> bool:
        p = self._for_key(victim)
        return not isinstance(p, Admitting) or bool(p.admits(victim, touch, key))

    def refused(self, keys: list[bytes], cls: int, touch: Touch) -> None:
        p = self.for_class(cls)
        if isinstance(p, Refusing):
            p.refused(keys, cls, touch)

    def describe(self, key: bytes) -> dict[str, Any] | None:
        p = self._for_key(key)
        return p.describe(key) if isinstance(p, Explaining) else None

    def counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for p in self.policies.values():
            for k, v in (p.counts() if isinstance(p, Explaining) else {}).items():
                total[k] = total.get(k, 0) + v
        return total

    def asked(self, keys: list[bytes], cls: int) -> None:
        p = self.for_class(cls)
        if isinstance(p, Asking):
            p.asked(keys, cls)

    def report(self) -> dict[str, Any]:
        """Each policy's own report, by name."""
        return {name: p.report() for name, p in self.policies.items() if isinstance(p, Reporting)}
