"""The package map's one-way rules, checked on the source (every import, module level or lazy).

engine            imports nothing from app
app.protocol, app.audio, app.config   the base: import no other app package
app.stages        the base, and engine (the in-process LLM backend)
app.voice         the base, and of the stages only their interfaces (app.stages.base)
app.server        anything but clients and benchmarks
app.clients       the base only
benchmarks        (app.bench, engine.benchmarks) are imported by no product module; the one
                  exception is the ``parley`` command, which dispatches to them lazily
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = ("app.protocol", "app.audio", "app.config")
BENCHMARKS = ("app.bench", "engine.benchmarks")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for package in ("app", "engine") for p in (ROOT / package).rglob("*.py")}
    assert "app.voice.session" in found and "engine.llm_engine" in found
    return found


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import statement in the file."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # "from app import protocol" imports app.protocol
            found += [(f"{node.module}.{alias.name}", id(node) in top_level) for alias in node.names]
    return found


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def allowed(importer: str, imported: str, module_level: bool) -> bool:
    if not within(imported, "app", "engine"):
        return True  # third-party and the standard library are not ruled here
    if within(imported, *BENCHMARKS) and not within(importer, *BENCHMARKS):
        return importer == "app.cli" and not module_level
    if within(importer, "engine"):
        return within(imported, "engine")
    if within(importer, *BASE):
        return within(imported, *BASE) or imported == "app"
    if within(importer, "app.stages"):
        return within(imported, *BASE, "app.stages", "engine")
    if within(importer, "app.voice"):
        return within(imported, *BASE, "app.voice", "app.stages.base")
    if within(importer, "app.clients"):
        return within(imported, *BASE, "app.clients")
    if within(importer, "app.server"):
        return not within(imported, "app.clients", "app.cli")
    return True  # app.cli and the benchmarks may use any product module


def test_every_import_follows_the_package_map():
    broken = [
        f"{importer} imports {imported}"
        for importer, path in modules().items()
        for imported, module_level in imports(path)
        if not allowed(importer, imported, module_level)
    ]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(
    ("importer", "imported", "ok"),
    [
        ("engine.llm_engine", "app.config", False),
        ("app.voice.session", "app.stages.asr", False),
        ("app.voice.session", "app.stages.base", True),
        ("app.server.app", "app.bench.voice", False),
        ("app.cli", "app.bench.voice", True),
    ],
)
def test_the_rules_catch_what_they_should(importer, imported, ok):
    assert allowed(importer, imported, module_level=False) is ok


def test_product_modules_import_without_matplotlib():
    """``parley serve`` (and every other product module) needs no plotting library."""
    product = sorted(name for name in modules() if not within(name, *BENCHMARKS))
    code = (
        "import importlib, sys\n"
        "sys.modules['matplotlib'] = None  # makes `import matplotlib` fail\n"
        f"for name in {product!r}:\n"
        "    importlib.import_module(name)\n"
        "from app.cli import build_parser\n"
        "build_parser().parse_args(['serve', '--port', '0'])\n"
        "assert 'matplotlib' not in [m for m, v in sys.modules.items() if v is not None]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
