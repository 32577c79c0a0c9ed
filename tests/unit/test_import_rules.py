"""The package map's one-way rules, checked on the source (every import, module level or lazy).

engine            imports nothing from app
engine core       everything in engine but the API and the edges (engine.openai_api, engine.cli,
                  engine.doctor, engine.benchmarks) imports nothing from engine.openai_api: the API
                  sits on the engine, never under it
engine.structured_output   the low floor beside the sampler (formats, grammars): nothing from
                  engine.openai_api (the request schema, the tool parser, the chat plan)
app.protocol, app.audio, app.config, app.policy   the base: import no other app package; of the engine only
                  engine.model_traits (what a model is, read from its header: the policy follows the model)
app.stages        the base, and engine (the in-process LLM backend)
app.skills        the base and the skills (the assistant's abilities, tools a session may call)
app.voice         the base, and of the stages and skills only their interfaces (app.stages.base,
                  app.skills.base): the server hands a session its models and its skills
app.server        anything but clients and benchmarks
app.clients       the base only
app.scale         the base, and of the engine only where models live and its settings (engine.weights,
                  engine.config): it runs the servers as processes, never their code
benchmarks        (app.bench, engine.benchmarks) are imported by no product module; the one
                  exception is the ``parley`` command, which dispatches to them lazily
no cycles         no two modules import each other, however indirectly, lazy imports included:
                  a function-level import must not hide a cycle
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = ("app.protocol", "app.audio", "app.config", "app.policy")
BENCHMARKS = ("app.bench", "engine.benchmarks")
OPENAI_API = "engine.openai_api"
STRUCTURED_OUTPUT = "engine.structured_output"
ENGINE_EDGES = (OPENAI_API, "engine.cli", "engine.doctor", "engine.benchmarks")  # may import the API


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for package in ("app", "engine") for p in (ROOT / package).rglob("*.py")}
    assert "app.voice.session" in found and "engine.llm_engine" in found
    return found


@dataclass(frozen=True)
class Import:
    module: str  # the project module the statement runs
    line: int
    module_level: bool


def imports(importer: str, source: str, known: Iterable[str], is_package: bool = False) -> list[Import]:
    """Every project module ``source`` (the text of module ``importer``, a package's ``__init__`` when
    ``is_package``) imports, at module level or lazily.

    Relative imports are resolved; ``from pkg import name`` imports ``pkg.name`` when that is a
    module, else ``pkg``; a dotted name stands for its longest prefix that is a project module.
    """
    known = set(known)
    package = importer if is_package else importer.rpartition(".")[0]
    tree = ast.parse(source)
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]  # level 1: this package, 2: its parent...
                base = f"{anchor}.{node.module}" if node.module else anchor
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != importer:
                found.append(Import(name, node.lineno, id(node) in top_level))
    return found


@functools.cache  # the files do not change during a run; three tests read the graph
def project_imports() -> dict[str, list[Import]]:
    found = modules()
    return {name: imports(name, path.read_text(), found, path.name == "__init__.py") for name, path in found.items()}


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def allowed(importer: str, imported: str, module_level: bool) -> bool:
    if not within(imported, "app", "engine"):
        return True  # third-party and the standard library are not ruled here
    if within(imported, *BENCHMARKS) and not within(importer, *BENCHMARKS):
        return importer == "app.cli" and not module_level
    if within(importer, STRUCTURED_OUTPUT) and within(imported, OPENAI_API):
        return False  # the grammars sit beside the sampler, below the API that uses them
    if within(importer, "engine") and within(imported, OPENAI_API):
        return within(importer, *ENGINE_EDGES)  # the engine core never reaches up into its API
    if within(importer, "engine"):
        return within(imported, "engine")
    if within(importer, *BASE):
        return within(imported, *BASE) or imported in ("app", "engine.model_traits")
    if within(importer, "app.stages"):
        return within(imported, *BASE, "app.stages", "engine")
    if within(importer, "app.skills"):
        return within(imported, *BASE, "app.skills")
    if within(importer, "app.voice"):
        return within(imported, *BASE, "app.voice", "app.stages.base", "app.skills.base")
    if within(importer, "app.clients"):
        return within(imported, *BASE, "app.clients")
    if within(importer, "app.scale"):
        return within(imported, *BASE, "app.scale", "engine.weights", "engine.config")
    if within(importer, "app.server"):
        return not within(imported, "app.clients", "app.cli")
    return True  # app.cli and the benchmarks may use any product module


def test_every_import_follows_the_package_map():
    broken = [
        f"{importer}:{imp.line} imports {imp.module}"
        for importer, found in project_imports().items()
        for imp in found
        if not allowed(importer, imp.module, imp.module_level)
    ]
    assert not broken, "\n".join(broken)


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycles():
    graph = project_imports()
    found = cycles({name: [imp.module for imp in found] for name, found in graph.items()})
    report = [
        " <-> ".join(component)
        + "".join(
            f"\n    {name}:{imp.line} imports {imp.module}"
            for name in component
            for imp in graph[name]
            if imp.module in component
        )
        for component in found
    ]
    assert not found, "import cycles:\n" + "\n".join(report)


def test_cycles_are_found():
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []


def test_lazy_relative_and_from_package_imports_count():
    known = ["pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"]
    source = "import os\nfrom pkg import b, helper\ndef later():\n    from .sub import c\n    import pkg.sub.c.thing\n"
    got = [(imp.module, imp.line, imp.module_level) for imp in imports("pkg.a", source, known)]
    assert got == [("pkg.b", 2, True), ("pkg", 2, True), ("pkg.sub.c", 4, False), ("pkg.sub.c", 5, False)]
    in_package = imports("pkg.sub", "from . import c\nfrom .. import a\n", known, is_package=True)
    assert [imp.module for imp in in_package] == ["pkg.sub.c", "pkg.a"]


@pytest.mark.parametrize(
    ("importer", "imported", "ok"),
    [
        ("engine.llm_engine", "app.config", False),
        ("app.voice.session", "app.stages.asr", False),
        ("app.voice.session", "app.stages.base", True),
        ("app.voice.session", "app.skills.timers", False),
        ("app.skills.timers", "app.voice.tools", False),
        ("app.server.app", "app.bench.voice", False),
        ("app.cli", "app.bench.voice", True),
        ("engine.structured_output.grammar", "engine.openai_api.protocol", False),
        ("engine.structured_output.formats", "engine.openai_api.tool_parser", False),
        ("engine.sampling", "engine.openai_api.protocol", False),
        ("engine.llm_engine", "engine.openai_api.api_server", False),
        ("engine.chat", "engine.openai_api.tool_plan", False),
        ("engine.openai_api.tool_plan", "engine.structured_output.grammar", True),
        ("engine.openai_api.protocol", "engine.sampling", True),
        ("engine.cli", "engine.openai_api.api_server", True),
        ("app.stages.llm", "engine.openai_api.tool_parser", True),
    ],
)
def test_the_rules_catch_what_they_should(importer, imported, ok):
    assert allowed(importer, imported, module_level=False) is ok


def test_the_engine_floors_exist():
    """The API and structured-output rules name real packages: a rename must not leave them checking nothing."""
    found = modules()
    assert {f"{OPENAI_API}.{m}" for m in ("api_server", "protocol", "tool_plan", "tool_parser")} <= set(found)
    assert {f"{STRUCTURED_OUTPUT}.{m}" for m in ("formats", "grammar")} <= set(found)
    assert {"engine.cli", "engine.doctor", "engine.benchmarks"} <= set(found)
    assert not any(within(name, "engine.tools") or name in ("engine.protocol", "engine.api_server") for name in found)


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
