"""The layering of the package, read from its import statements (every ``import`` and ``from ...
import`` of a module, at the top or inside a function; ``if TYPE_CHECKING:`` blocks excepted):

* ``functional/`` imports nothing of ours but ``exceptions`` and ``_imports``;
* ``sandbox/`` imports nothing of ours but ``exceptions`` and ``_imports`` (its workers load
  ``sandbox/_runtime`` alone);
* ``exceptions`` and ``_imports`` (lazy exports, install hints) import nothing of ours;
* ``checkpoint/``, ``rollout/`` and ``tracking/`` import neither ``engine/`` nor ``trainers/``;
* ``engine/`` imports no public facade (``utils/``, ``schedulers/``, the package root) and no family;
* ``algorithms/`` (algorithms written as a user would) imports ``extend`` and ``exceptions`` only;
* no import cycle, of two files or more.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "comlrl"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The comlrl modules ``name`` imports (a name imported from a package counts as its module
    when it is one, else as the package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def test_layers_import_only_downwards():
    rules = {
        "functional": lambda target: _layer(target) in ("functional", "exceptions", "_imports"),
        "checkpoint": lambda target: _layer(target) not in ("engine", "trainers"),
        "rollout": lambda target: _layer(target) not in ("engine", "trainers"),
        "tracking": lambda target: _layer(target) not in ("engine", "trainers"),
        "sandbox": lambda target: _layer(target) in ("sandbox", "exceptions", "_imports"),
        "exceptions": lambda target: False,
        "_imports": lambda target: False,
        "engine": lambda target: _layer(target) not in ("utils", "schedulers", "trainers", "<root>"),
        "algorithms": lambda target: _layer(target) in ("algorithms", "extend", "exceptions", "_imports"),
    }
    broken = sorted((m, t) for m, targets in GRAPH.items() for t in targets
                    if _layer(m) in rules and not rules[_layer(m)](t))
    assert not broken, broken


def test_no_module_imports_one_that_imports_it_back():
    """Tarjan's strongly connected components of the import graph: every one a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not cycles, cycles


def test_the_graph_is_read():
    """The reader finds what it must (a guard against a test that could never fail)."""
    assert "comlrl.checkpoint.files" in GRAPH["comlrl.checkpoint.manager"]
    assert "comlrl.engine.trainer" in GRAPH["comlrl.trainers.reinforce.magrpo"]
    assert _imports("comlrl.engine.x", PACKAGE / "engine" / "trainer.py", _modules()) >= {"comlrl.engine.loop"}


def _private_imports_across_packages() -> list[tuple[str, str, str]]:
    """``(importer, module, name)`` of every ``from module import _name`` (dunders aside) whose
    module lies in another package than the importer: a name with a leading underscore is its
    package's internal, so a module elsewhere that needs it needs a public name."""
    modules = _modules()
    out = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            if stem.split(".")[0] != "comlrl":
                continue
            target = stem if stem in modules else stem.rsplit(".", 1)[0]
            target_package = target if modules.get(target, Path()).name == "__init__.py" else target.rsplit(".", 1)[0]
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{stem}.{alias.name}" not in modules and target_package != package:
                    out.append((name, stem, alias.name))
    return sorted(out)


def test_no_private_name_is_imported_from_another_package():
    assert not _private_imports_across_packages(), _private_imports_across_packages()
