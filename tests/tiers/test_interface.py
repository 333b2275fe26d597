"""The tier interface holds: nothing outside a tier's own package names it (the registry names its module as a
string), and every registered tier implements every method of `LowerTier`."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import kvstore
from kvstore.tiers import LowerTier
from kvstore.tiers.registry import STACKED, TIER_TYPES

ALL_TIERS = {name: entry.module for name, entry in {**TIER_TYPES, **STACKED}.items()}

PACKAGE = Path(kvstore.__file__).parent


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def tier_package(module: str) -> str:
    """What belongs to a tier: its package (kvstore.tiers.ssd), or its module where it is one file."""
    parent = module.rsplit(".", 1)[0]
    return module if parent == "kvstore.tiers" else parent


def test_no_index_op_server_or_mover_names_a_tier_module():
    tier_modules = tuple(tier_package(m) for m in ALL_TIERS.values())
    assert tier_modules == ("kvstore.tiers.ssd", "kvstore.tiers.remote", "kvstore.tiers.donated")
    # daemon/config.py composes the tiers' sections, imported from their packages' config modules only
    checked = [p for d in ("index", "daemon", "movers", "policy", "traffic") for p in (PACKAGE / d).glob("*.py")]
    assert len(checked) > 20                                 # the scan sees the code it guards
    offenders = {str(p.relative_to(PACKAGE)): sorted(m for m in imports_of(p) if m.startswith(tier_modules)
                                                     and not m.endswith(".config")) for p in checked}
    assert {f: m for f, m in offenders.items() if m} == {}


def test_every_registered_tier_implements_the_interface():
    wanted = {name for name in dir(LowerTier) if not name.startswith("_")} | set(LowerTier.__annotations__)
    assert {"stage", "fill", "read", "read_async", "write", "announce", "delete", "has", "path"} <= wanted
    for module in ALL_TIERS.values():
        mod = importlib.import_module(module)
        assert callable(getattr(mod, "open_tier", None)), f"{module} has no open_tier(config, traffic)"
        tier_cls = inspect.signature(mod.open_tier).return_annotation
        classes = [c for _, c in inspect.getmembers(mod, inspect.isclass) if c.__module__ == mod.__name__
                   and getattr(c, "name", None) and callable(getattr(c, "stage", None))]
        assert classes, f"{module} defines no tier class ({tier_cls})"
        for cls in classes:
            missing = sorted(n for n in wanted if n != "path" and not hasattr(cls, n))
            assert missing == [], f"{cls.__name__} lacks {missing}"
