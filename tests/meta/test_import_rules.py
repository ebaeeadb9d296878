"""The package layering of docs/ARCHITECTURE.md, measured from the source (imports inside functions
included): the process groups know nothing of random numbers or layers, models and blocks do not import
the pipeline runtime, only the Lightning adapter and the recipes import Lightning, no module imports
itself back through others (package faces included), and the machinery imports fast without Lightning."""

import ast
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

from helpers.paths import ROOT

PACKAGE = Path(ROOT) / "lightning_megatron"
# where Lightning (and torchmetrics) may be imported; the rest is the machinery
LIGHTNING_SIDE = ("adapter", "recipes", "__main__")
# packages (and root modules) of the machinery, each importable without Lightning
MACHINERY = ("parallel", "tensor_parallel", "context_parallel", "transformer", "moe", "pipeline", "distributed",
             "engine", "cuda_graphs", "checkpoint", "models", "ops", "quantization", "testing")


def _modules():
    """{dotted module name: (path, is package face)} for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return out


MODULES = _modules()


def _imports():
    """({module: {our modules it imports}}, {module: {external top-level packages it imports}}), over every
    import statement wherever it sits, except those under ``if TYPE_CHECKING``."""
    ours, external = defaultdict(set), defaultdict(set)
    for name, (path, is_init) in MODULES.items():
        tree = ast.parse(path.read_text())
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_init else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + (node.module.split(".") if node.module else []))
                else:
                    target = node.module
                if not target.startswith("lightning_megatron"):
                    external[name].add(target.split(".")[0])
                    continue
                for alias in node.names:   # `from pkg import submodule` imports the submodule
                    sub = f"{target}.{alias.name}"
                    ours[name].add(sub if sub in MODULES else target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("lightning_megatron"):
                        ours[name].add(alias.name)
                    else:
                        external[name].add(alias.name.split(".")[0])
    return ours, external


OURS, EXTERNAL = _imports()


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lightning_megatron"


def _package_edges(package: str) -> set:
    """Our packages that ``package``'s modules import (private infrastructure like ``_lazy`` left out)."""
    return {_package(t) for m, targets in OURS.items() if _package(m) == package for t in targets
            if _package(t) != package and not _package(t).startswith("_")}


def test_process_groups_import_nothing_of_ours():
    assert _package_edges("parallel") == set()


def test_models_and_blocks_do_not_import_the_pipeline():
    assert "pipeline" not in _package_edges("models") and "pipeline" not in _package_edges("transformer")


def test_the_machinery_does_not_import_the_adapter_or_the_recipes():
    for package in MACHINERY:
        assert not _package_edges(package) & {"adapter", "recipes"}, package


def test_only_the_adapter_and_the_recipes_import_lightning():
    for module, packages in EXTERNAL.items():
        if _package(module) not in LIGHTNING_SIDE:
            assert "lightning" not in packages and "pytorch_lightning" not in packages, module


def test_no_import_circles_package_faces_included():
    """Tarjan's strongly connected components over module-to-module imports: every one is a single module."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in OURS.get(v, ()):
            if w == v or w not in MODULES:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for module in MODULES:
        if module not in index:
            visit(module)
    assert circles == []


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter (import timings use the process's CPU time: a loaded machine waits,
    it does not import more)."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_pure_modules_import_in_under_a_second_without_torch_or_lightning():
    """Topology, the stage split and the schedules are integer code: importing them pays for nothing else."""
    out = _run("""
        import sys, time
        start = time.process_time()
        import lightning_megatron
        import lightning_megatron.parallel.topology, lightning_megatron.parallel.stages
        import lightning_megatron.pipeline.schedules
        elapsed = time.process_time() - start
        print(elapsed, sorted(m for m in ("torch", "lightning", "torchmetrics", "numpy") if m in sys.modules))
    """)
    elapsed, loaded = out.split(" ", 1)
    assert loaded.strip() == "[]"
    assert float(elapsed) < 1.0


def test_machinery_imports_without_lightning_in_under_a_second_beyond_torch():
    modules = sorted(m for m in MODULES if _package(m) in MACHINERY)
    out = _run(f"""
        import sys, time
        # torch's own costs, paid by any torch program that checkpoints: torch 2.3 s, its checkpointing 1.2 s here
        import torch, torch.distributed, torch.distributed.checkpoint, numpy
        start = time.process_time()
        import lightning_megatron
        for name in {modules!r}:
            __import__(name)
        elapsed = time.process_time() - start
        print(elapsed, sorted(m for m in ("lightning", "pytorch_lightning", "torchmetrics") if m in sys.modules))
    """)
    elapsed, loaded = out.split(" ", 1)
    assert loaded.strip() == "[]"
    assert float(elapsed) < 1.0, elapsed   # all of them together


def test_megatron_strategy_name_registers_whichever_is_imported_first():
    for first, second in (("lightning_megatron", "lightning.pytorch"), ("lightning.pytorch", "lightning_megatron")):
        out = _run(f"""
            import importlib, sys
            importlib.import_module({first!r}); importlib.import_module({second!r})
            from lightning.pytorch.strategies import StrategyRegistry
            strategy = StrategyRegistry.get("megatron")
            print(type(strategy).__module__ + "." + type(strategy).__name__)
        """)
        assert out.strip() == "lightning_megatron.adapter.strategy.MegatronStrategy", (first, out)


def test_the_architecture_table_is_what_the_code_imports():
    """docs/ARCHITECTURE.md's "What may import what" table lists, per package, exactly the packages it imports."""
    import re

    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \|([^|]*)\|", text, flags=re.M)
    documented = {package: set(re.findall(r"`(\w+)`", listed)) for package, listed in rows}
    packages = {_package(m) for m in MODULES if "." in m and not _package(m).startswith("_")} - {"__main__"}
    assert set(documented) == packages
    for package, listed in documented.items():
        assert _package_edges(package) == listed, package


def test_the_strategy_class_stays_a_thin_adapter():
    """docs/ARCHITECTURE.md: ``MegatronStrategy`` is Lightning plumbing and hand-offs to the machinery (<= 300
    lines); the step protocol, logging, loaders, evaluation and checkpoint hooks live in their own files."""
    tree = ast.parse((PACKAGE / "adapter" / "strategy.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MegatronStrategy"]
    assert cls.end_lineno - cls.lineno + 1 <= 300


def test_public_names_of_the_lazy_faces_are_what_they_name_after_every_module_is_imported():
    """A name loaded on first use must not turn into a submodule once that submodule has been imported."""
    out = _run(f"""
        import importlib, types
        for name in {sorted(m for m in MODULES if not m.endswith("__main__"))!r}:
            importlib.import_module(name)
        wrong = []
        for face in ("lightning_megatron", "lightning_megatron.parallel", "lightning_megatron.pipeline",
                     "lightning_megatron.adapter"):
            module = importlib.import_module(face)
            wrong += [f"{{face}}.{{n}}" for n in module.__all__ if isinstance(getattr(module, n), types.ModuleType)]
        print(wrong)
    """)
    assert out.strip() == "[]"
