"""The package layout keeps its promises: no import cycle, no method branch outside scorers/."""
from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "anomaly_hooks"


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PACKAGE.rglob("*.py")}


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (annotations only: such
    an import never runs, so it cannot close a cycle)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)):
                todo.append(child)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports at run time anywhere (also inside functions)."""
    files = _modules()
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("anomaly_hooks"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in files else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("anomaly_hooks")}
        # a submodule importing its own package (for a sibling) is not a cycle
        graph[name] = {d for d in deps if d in files and d != name and
                       not name.startswith(d + ".")}
    return graph


def test_no_import_cycles():
    graph = _import_graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, cycles
    assert "anomaly_hooks.scorers" in graph["anomaly_hooks.detector"]  # the check sees edges


def test_no_method_branches_outside_the_scorers():
    pattern = re.compile(r"""(==|!=|\bin\b)\s*\(?["'](padim|patchcore)["']""")
    offenders = [f"{path.relative_to(ROOT)}:{i}"
                 for path in PACKAGE.rglob("*.py") if "scorers" not in path.parts
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if pattern.search(line)]
    assert not offenders, offenders


def test_torch_free_modules_import_no_torch():
    torch_free = ["errors", "choices", "framing", "images", "prediction", "threshold",
                  "calibration", "__init__"]
    for name in torch_free:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(m == "torch" or m.startswith("torch.") for m in names), name


def test_config_choices_are_enums_that_pickle():
    from anomaly_hooks.config import load_config

    cfg = load_config(None, ["method=patchcore", "patchcore.knn_backend=faiss-flat"])
    for value in (cfg.method, cfg.patchcore.knn_backend, cfg.backbone.precision,
                  cfg.padim.covariance, cfg.data.on_error, cfg.threshold.mode,
                  cfg.threshold.tail):
        assert pickle.loads(pickle.dumps(value)) == value
        assert str(value) == f"{value}" == value.value
