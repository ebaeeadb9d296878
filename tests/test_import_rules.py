"""The package layering of docs/ARCHITECTURE.md, measured from the source (imports inside functions
included): the process groups know nothing of random numbers or layers, models and blocks do not import
the pipeline runtime, the layers below the step engine do not import Lightning, and no two packages
import each other."""

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_megatron"


def _imports():
    """{package: {packages it imports}} over every import statement, wherever it sits."""
    edges = defaultdict(set)
    external = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = list(rel.parts)
        is_init = module[-1] == "__init__"
        if is_init:
            module = module[:-1]
        source = module[1] if len(module) > 1 else "lightning_megatron"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = module if is_init else module[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
                names = [target + [a.name] for a in node.names] if len(target) == 1 else [target]
                for name in names:
                    edges[source].add(name[1] if len(name) > 1 else "lightning_megatron")
            elif isinstance(node, ast.ImportFrom) and node.module:
                external[source].add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                external[source].update(a.name.split(".")[0] for a in node.names)
    for source in edges:
        edges[source].discard(source)
    return edges, external


EDGES, EXTERNAL = _imports()


def test_process_groups_import_nothing_of_ours():
    assert EDGES["parallel"] == set()


def test_models_and_blocks_do_not_import_the_pipeline():
    assert "pipeline" not in EDGES["models"] and "pipeline" not in EDGES["transformer"]


def test_below_the_strategy_nothing_imports_lightning():
    for package in ("parallel", "tensor_parallel", "context_parallel", "transformer", "moe", "pipeline",
                    "distributed", "engine", "cuda_graphs", "checkpoint", "models"):
        assert "lightning" not in EXTERNAL[package], package


def test_no_two_packages_import_each_other():
    def reaches(start, goal):
        seen, todo = set(), [start]
        while todo:
            for nxt in EDGES.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    circles = sorted((a, b) for a in EDGES for b in EDGES[a] if a < b and reaches(b, a))
    assert circles == []
