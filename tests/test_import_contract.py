"""The arrows of the house: every module of kvstore imports, at run time, only modules of its own layer or of the
layers below it (imports under `if TYPE_CHECKING:` are annotations, not arrows). So the tiers never reach up into
the daemon, the policies never into the index or the tiers, and a leaf (protocol, checksum, testpoints, ...)
imports nothing of kvstore above it. A module that must break a rule is a design change: move the code, not the
rule.

Top to bottom (DESIGN.md, README "Layout"):
  entry points: cli, __main__, the package's __init__
  daemon, client          (the daemon's composition root and ops; the engines' side — neither imports the other)
  movers                  (who moves bytes between tiers)
  index                   (the books: key -> slot, pins, quotas)
  tiers                   (where bytes live: host pool, SSD, remote, donated)
  policy                  (who leaves a full tier)
  workflows, traffic      (what the hints say; the priority lanes every byte goes through)
  leaves                  (protocol, checksum, units, histogram, hll, workers, private_dir, testpoints, natives)
"""
from __future__ import annotations

import ast
from pathlib import Path

import kvstore

PACKAGE = Path(kvstore.__file__).parent
LAYERS: list[set[str]] = [
    {"cli", "__main__", "__init__"},
    {"daemon", "client"},
    {"movers"},
    {"index"},
    {"tiers"},
    {"policy"},
    {"workflows", "traffic"},
    {"protocol", "checksum", "units", "histogram", "hll", "workers", "private_dir", "testpoints", "_kvindex",
     "_kvcopy", "_kvuring"},
]
PEERS_APART = [("daemon", "client")]          # same layer, and still no arrow between them


def part_of(module: str) -> str:
    """kvstore.tiers.ssd.tier -> tiers; kvstore.units -> units; kvstore -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(part: str) -> int:
    for i, names in enumerate(LAYERS):
        if part in names:
            return i
    raise AssertionError(f"kvstore.{part} is in no layer of this test: place it (tests/test_import_contract.py)")


def runtime_imports(path: Path) -> set[str]:
    """The kvstore modules `path` imports outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "kvstore":      # submodules by name; the root
            names = [f"kvstore.{a.name}" for a in node.names if _submodule(a.name)]   # package's own names (its
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:  # version) are no arrow
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "kvstore" or n.startswith("kvstore."))
    return found


def _submodule(name: str) -> bool:
    return (PACKAGE / f"{name}.py").exists() or (PACKAGE / name / "__init__.py").exists()


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def arrows() -> list[tuple[str, str]]:
    return [(module_name(p), imported) for p in sorted(PACKAGE.rglob("*.py")) for imported in runtime_imports(p)]


def test_every_arrow_points_down_or_across() -> None:
    found = arrows()
    assert len(found) > 300                                   # the scan sees the code it guards
    upward = [f"{src} -> {dst}" for src, dst in found
              if layer_of(part_of(dst)) < layer_of(part_of(src))]
    assert upward == []


def test_peers_in_one_layer_stay_apart() -> None:
    crossing = [f"{src} -> {dst}" for src, dst in arrows() for a, b in PEERS_APART
                if {part_of(src), part_of(dst)} == {a, b}]
    assert crossing == []


def test_nothing_below_the_daemon_imports_it() -> None:
    """The issue's own words: no module under tiers/, traffic/, movers/, index/ or policy/ imports daemon."""
    below = ("tiers", "traffic", "movers", "index", "policy", "workflows")
    offenders = [f"{src} -> {dst}" for src, dst in arrows() if part_of(src) in below and part_of(dst) == "daemon"]
    assert offenders == []


def test_testpoints_is_a_leaf() -> None:
    assert runtime_imports(PACKAGE / "testpoints.py") == set()


def test_a_tier_sees_its_own_section_only() -> None:
    """Each tier's open_tier takes its section and the TierContext; no tier module reads the daemon's Config."""
    from kvstore.tiers.registry import STACKED, TIER_TYPES

    for section, entry in {**TIER_TYPES, **STACKED}.items():
        package = PACKAGE / Path(*entry.module.split(".")[1:-1])
        assert entry.config.startswith(f"kvstore.{'.'.join(package.relative_to(PACKAGE).parts)}.config:")
        assert (package / "config.py").exists(), f"{section}: its section's dataclass belongs in its package"
        for path in package.glob("*.py"):
            assert "kvstore.daemon.config" not in runtime_imports(path), path


def test_the_layers_name_every_part() -> None:
    parts = {p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py")}
    for part in parts:
        layer_of(part)
