"""The package's shape, checked from its source: no import cycles, no import of a higher layer,
no file over 600 lines, a one-line job at the top of every module's docstring.

Read with ``ast`` only (nothing under regress/ is imported), so this runs in a fraction of a
second. The rules are the conventions of DESIGN.md; :data:`LAYERS` is its layer list.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "regress"
MAX_LINES = 600

LAYERS: dict[str, int] = {
    # Module name prefixes (below regress) -> layer; a module may import its own layer or lower
    # ones. The longest prefix wins; a prefix matches the module of that name and everything
    # under it. A module no prefix matches fails the test: place a new module here.
    "": 0,  # regress/__init__.py itself (its public names are imported lazily, by name)
    # L0 records and errors
    "errors": 0, "storage": 0, "records": 0, "home": 0, "redact": 0, "validation": 0, "plugins": 0,
    "progress": 0, "stats": 0, "quality_stats": 0, "metrics.spec": 0, "metrics.answers": 0, "noise.record": 0, "diagnosis.record": 0, "replay.sink": 0,
    "engine.vocabulary": 0, "report.annotations": 0, "quantize_entry": 0, "untrusted": 0,
    "project_lock": 0, "watchdog": 0, "power.record": 0, "engine_args": 0, "prewarm": 0,
    # The packages whose modules have no common layer (their __init__ imports nothing): a new
    # module in them is at 0 until it is placed.
    "diagnosis": 0, "noise": 0, "power": 0,
    # L1 settings and inputs
    "config": 1, "worker.settings": 1, "watch.config": 1, "watch.settings": 1, "diagnosis.settings": 1, "quick_sample": 1,
    "noise.settings": 1, "datasets": 1, "runs": 1, "run_values": 1, "run_pairs": 1, "envs": 1, "provenance": 1, "effective": 1, "verdict": 1,
    "quality": 1, "gate_check": 1, "thresholds_check": 1,
    "latency": 1, "trend": 1, "deadlines": 1,
    # The plugin registries and interfaces sit with the settings that name plugins (config checks
    # a backend name, the verdict reads the metric specs): the package faces and their base
    # modules. The plugins themselves are higher: place each new one below.
    "backends": 1, "backends.base": 1, "metrics": 1, "metrics.base": 1,
    # L2 engines
    "engine": 2, "backends.vllm_offline": 2, "backends.vllm_server": 2, "backends.server_process": 2,
    "backends.server_wire": 2, "backends.hf_reference": 2, "runner": 2, "fixture_model": 2, "pretrained": 2,
    "model_variants": 2, "quantize": 2, "backends.server_http": 2,
    # L3 replay and measures
    "replay": 3, "metrics.tokens": 3, "metrics.teacher_forced": 3, "metrics.surface": 3,
    "metrics.semantic": 3, "metrics.embedder": 3, "metrics.sampled": 3, "metrics.sampled_policy": 3,
    "metrics.aggregate": 3, "metrics.sample_scorer": 3, "scoring": 3, "noise.floor": 3, "noise.beyond": 3, "diagnosis.probes": 3, "diagnosis.attribute": 3,
    # L4 orchestration
    "checks": 4, "preflight": 4, "scaffold": 4, "noise.arms": 4, "power.ladder": 4, "quick": 4, "diagnosis.run": 4, "worker": 4, "report": 4,
    # L5 commands
    "cli": 5, "__main__": 5, "cli_boundary": 5, "cli_output": 5, "cli_options": 5, "cli_guard": 5, "cli_help": 5, "cli_results": 5, "envs.cli": 5, "watch": 5, "bisect": 5,
    "power.cli": 5,
}


def _name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


@functools.lru_cache(maxsize=1)
def _modules() -> dict[str, tuple[Path, ast.Module, str]]:
    """Module name -> (file, syntax tree, source) of every module under regress/."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        found[_name(path)] = (path, ast.parse(source, filename=str(path)), source)
    return found


def _is_package(name: str) -> bool:
    return _modules()[name][0].name == "__init__.py"


def _known(dotted: str) -> str | None:
    """The module under regress/ that ``dotted`` names or lies in (``a.b.Name`` -> ``a.b``)."""
    modules = _modules()
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement of module ``name`` loads (relative ones resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = name.split(".")
        # In a package's __init__, level 1 is the package itself; in a module, its package.
        keep = len(parts) - node.level + (1 if _is_package(name) else 0)
        base = ".".join(parts[:keep] + ([base] if base else []))
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _imports(body: list[ast.AST]) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``body``, at any depth (functions, classes, if/try/with, match).
    Only statements are searched: an expression cannot hold an import statement."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        for _, value in ast.iter_fields(node):
            if isinstance(value, list):
                found += _imports([v for v in value if isinstance(v, (ast.stmt, ast.excepthandler, ast.match_case))])
    return found


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line of the first such import}, every import statement
    counted (in functions and under TYPE_CHECKING too). An import of one of the module's own
    packages is left out: a submodule cannot be loaded without its packages, whatever it imports."""
    graph: dict[str, dict[str, int]] = {}
    for name, (_, tree, _) in _modules().items():
        edges: dict[str, int] = {}
        for node in _imports(tree.body):
            for dotted in _imported(name, node):
                if dotted.split(".")[0] != PACKAGE.name:
                    continue
                target = _known(dotted)
                if target is None or target == name or name.startswith(target + "."):
                    continue
                edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def layer_of(name: str) -> int | None:
    """The layer of module ``name`` (``regress.x.y``) by the longest matching prefix; None: unplaced."""
    short = name.removeprefix(PACKAGE.name).removeprefix(".")
    best: str | None = None
    for prefix in LAYERS:
        matches = short == prefix or (prefix != "" and short.startswith(prefix + "."))
        if matches and (best is None or len(prefix) > len(best)):
            best = prefix
    return None if best is None else LAYERS[best]


def test_the_graph_is_read_from_the_code() -> None:
    # Guards the checks below against passing on an empty or unresolved graph.
    graph = import_graph()
    assert "regress.scoring" in graph and "regress.metrics.spec" in graph
    assert "regress.verdict" in graph["regress.scoring"]
    assert graph["regress.diagnosis.probes"].keys() >= {"regress.diagnosis.record", "regress.diagnosis.settings"}


def test_no_import_cycles() -> None:
    graph = import_graph()
    problems = []
    for component in _cycles(graph):
        edges = [f"{a} -> {b} (line {graph[a][b]})" for a in component for b in sorted(graph[a]) if b in component]
        problems.append(f"import cycle among {', '.join(component)}:\n    " + "\n    ".join(edges))
    assert not problems, "\n".join(problems)


def test_no_module_imports_a_higher_layer() -> None:
    graph = import_graph()
    unplaced = sorted(name for name in graph if layer_of(name) is None)
    upward = []
    for name, edges in sorted(graph.items()):
        mine = layer_of(name)
        if mine is None:
            continue
        for target, line in sorted(edges.items()):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{name} (L{mine}) imports {target} (L{theirs}) at line {line}")
    problems = [f"{name}: in no layer (add its prefix to LAYERS in {Path(__file__).name})" for name in unplaced]
    assert not problems + upward, "\n".join(problems + upward)


def test_no_file_is_over_the_line_limit() -> None:
    long = []
    for _, (path, _, source) in sorted(_modules().items()):
        lines = len(source.splitlines())
        if lines > MAX_LINES:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines (limit {MAX_LINES})")
    assert not long, "\n".join(long)


MAX_SUMMARY = 100
SENTENCE_ENDS = (".", ":", "?", "!")


def test_every_module_says_its_job_first() -> None:
    # The first line must be a whole sentence: a summary cut at the line break (the sentence
    # running on into the next line) does not end with a sentence's punctuation.
    missing = []
    for _, (path, tree, _) in sorted(_modules().items()):
        name = path.relative_to(PACKAGE.parent)
        doc = ast.get_docstring(tree, clean=False)  # cleaning would drop a blank first line
        if doc is None:
            missing.append(f"{name}: no module docstring")
            continue
        first = doc.split("\n", 1)[0].strip()
        if not first:
            missing.append(f"{name}: the docstring's first line is empty")
        elif len(first) > MAX_SUMMARY:
            missing.append(f"{name}: the first line is {len(first)} characters (limit {MAX_SUMMARY}): {first!r}")
        elif not first.endswith(SENTENCE_ENDS):
            missing.append(f"{name}: the first line is not a whole sentence (it ends without "
                           f"{' '.join(SENTENCE_ENDS)}): {first!r}")
    assert not missing, "\n".join(missing)
