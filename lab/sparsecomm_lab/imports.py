"""The library's import rules, checked by reading its source: the layer architecture made testable.

Layers, bottom to top (``docs/architecture.md``)::

    core < transport < selection < methods < integration < launch < simulator < cli

Rules (:func:`violations` lists every breach; ``tests/test_architecture.py`` requires none):

1. A module imports only from its own layer or below (lazy imports inside functions included).
2. Method modules never import each other. A *method module* is a module of
   ``sparsecomm.methods`` that registers a method; a method split into a subpackage
   (``methods/spardl/``) is one method. What methods share lives in the methods layer's shared
   modules (``base``, ``stats``, ``select_allgather``) or below.
3. No module imports a private name (``_name``) from another module; a package's own modules may
   share its private parts (``from . import _private``).
4. The module import graph has no cycle (imports of a package's own ``__init__`` from its
   submodules excepted, since Python resolves those as parent-package imports).
5. The library never imports the lab (``sparsecomm_lab``), not even inside a function: the command
   line finds the lab's commands through the entry points the lab declares.

The package facade (``sparsecomm/__init__.py``, ``__main__.py``, ``selectors.py``) may import from
every layer. ``sparsecomm imports`` (a lab command) prints the breaches and draws the layer graph.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["LAYERS", "LAB_PACKAGE", "ModuleInfo", "scan_package", "layer_of", "violations", "layer_edges"]

LAYERS = ("core", "transport", "selection", "methods", "integration", "launch", "simulator", "cli")
#: the package of the experiments, which the library never imports
LAB_PACKAGE = "sparsecomm_lab"
_SHARED_METHOD_MODULES = {"sparsecomm.methods", "sparsecomm.methods.base", "sparsecomm.methods.stats",
                          "sparsecomm.methods.select_allgather"}


@dataclass
class ModuleInfo:
    """One module: its dotted name, file, whether it registers a method, and what it imports."""

    name: str
    path: str
    is_package: bool
    registers_method: bool = False
    #: (imported module, imported name or None, line)
    imports: list[tuple[str, str | None, int]] = field(default_factory=list)


def _module_name(root: str, path: str) -> tuple[str, bool]:
    rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
    if rel.endswith(".__init__"):
        return rel[: -len(".__init__")], True
    return rel, False


def _resolve(module: ModuleInfo, level: int, target: str | None) -> str:
    base = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def scan_package(root: str) -> dict[str, ModuleInfo]:
    """Every module under the package folder ``root`` with its imports of the package."""
    package = os.path.basename(root.rstrip(os.sep))
    modules: dict[str, ModuleInfo] = {}
    for folder, _, files in os.walk(root):
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            name, is_package = _module_name(root, path)
            info = ModuleInfo(name, path, is_package)
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    target = _resolve(info, node.level, node.module) if node.level else (node.module or "")
                    if _watched(target, package):
                        for alias in node.names:
                            info.imports.append((target, alias.name, node.lineno))
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if _watched(alias.name, package):
                            info.imports.append((alias.name, None, node.lineno))
                elif isinstance(node, ast.Call) and _is_register_method(node):
                    info.registers_method = True
            modules[name] = info
    # ``from pkg import sub`` names a submodule: record it as an import of that module
    for info in modules.values():
        info.imports = [(f"{target}.{name}", None, line) if name and f"{target}.{name}" in modules
                        else (target, name, line) for target, name, line in info.imports]
    return modules


def _watched(target: str, package: str) -> bool:
    """Whether an import of ``target`` is one the rules look at: the package's own modules and the lab."""
    return any(target == name or target.startswith(name + ".") for name in (package, LAB_PACKAGE))


def _is_register_method(node: ast.Call) -> bool:
    func = node.func
    return (isinstance(func, ast.Name) and func.id == "register_method") or \
        (isinstance(func, ast.Attribute) and func.attr == "register_method")


#: the top-level modules of the package facade besides its ``__init__``
FACADE_MODULES = ("__main__", "selectors")


def layer_of(module: str) -> int | None:
    """The layer index of a dotted module name, None for the package facade (root, ``__main__``,
    ``selectors``) and for a module outside every layer (a breach :func:`violations` reports)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] in FACADE_MODULES:
        return None
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def _method_unit(module: str, modules: dict[str, ModuleInfo]) -> str | None:
    """The method a module belongs to (its subpackage for a split method), None for shared modules."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "methods" or module in _SHARED_METHOD_MODULES:
        return None
    unit = ".".join(parts[:3])
    members = [m for m in modules if m == unit or m.startswith(unit + ".")]
    return unit if any(modules[m].registers_method for m in members) else None


def violations(modules: dict[str, ModuleInfo]) -> list[str]:
    """Every breach of the rules in the module docstring, one line each (empty when clean)."""
    found: list[str] = []
    for info in modules.values():
        mine = layer_of(info.name)
        parts = info.name.split(".")
        if len(parts) > 1 and parts[1] not in LAYERS and parts[1] not in FACADE_MODULES:
            found.append(f"{os.path.relpath(info.path)}: {info.name} lies in no layer ({', '.join(LAYERS)})")
        for target, name, line in info.imports:
            where = f"{os.path.relpath(info.path)}:{line}"
            theirs = layer_of(target)
            if target == LAB_PACKAGE or target.startswith(LAB_PACKAGE + "."):
                found.append(f"{where}: {info.name} imports {target}, a lab module")
            elif mine is not None and theirs is not None and theirs > mine:
                found.append(f"{where}: {info.name} ({LAYERS[mine]}) imports {target} ({LAYERS[theirs]}), "
                             f"a higher layer")
            a, b = _method_unit(info.name, modules), _method_unit(target, modules)
            if a and b and a != b:
                found.append(f"{where}: method module {info.name} imports method module {target}")
            own_package = info.name if info.is_package else info.name.rsplit(".", 1)[0]
            if name and name.startswith("_") and not name.startswith("__") and target not in (info.name, own_package):
                found.append(f"{where}: {info.name} imports the private name {name} from {target}")
    found.extend(f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(modules))
    return found


def _cycles(modules: dict[str, ModuleInfo]) -> list[list[str]]:
    graph = {name: sorted({t for t, _, _ in info.imports if t in modules and t != name
                           and not name.startswith(t + ".")}) for name, info in modules.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def layer_edges(modules: dict[str, ModuleInfo]) -> dict[tuple[str, str], int]:
    """Imports counted between the second-level packages (``transport``, ``methods.spardl``, ...)."""
    def group(module: str) -> str | None:
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in LAYERS:
            return None
        return ".".join(parts[1:3]) if parts[1] == "methods" and len(parts) > 2 \
            and modules.get(".".join(parts[:3]), ModuleInfo("", "", False)).is_package else parts[1]

    edges: dict[tuple[str, str], int] = {}
    for info in modules.values():
        source = group(info.name)
        for target, _, _ in info.imports:
            dest = group(target)
            if source and dest and source != dest:
                edges[(source, dest)] = edges.get((source, dest), 0) + 1
    return edges


def groups_by_layer(edges: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """The packages of :func:`layer_edges` sorted into their layers."""
    out: dict[str, list[str]] = {layer: [] for layer in LAYERS}
    for name in sorted({n for edge in edges for n in edge}):
        out[name.split(".")[0]].append(name)
    return out
