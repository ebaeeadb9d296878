"""``Trainer(strategy="megatron")`` after ``import lightning_megatron``, without importing Lightning for it.

Lightning has no entry-point discovery for strategies, so the name must be in its ``StrategyRegistry``
before the Trainer looks it up. If Lightning is already imported, the name is registered at once;
otherwise when ``lightning.pytorch.strategies`` is first imported (a one-shot import hook). Either way the
registered factory imports the strategy only when a Trainer asks for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

NAME = "megatron"
REGISTRY_MODULE = "lightning.pytorch.strategies"
DESCRIPTION = "Megatron-style tensor/pipeline/data/context/expert parallelism (lightning_megatron)"


def megatron_strategy(**kwargs: Any) -> Any:
    """What ``strategy="megatron"`` builds: ``MegatronStrategy(**kwargs)``."""
    from .adapter.strategy import MegatronStrategy

    return MegatronStrategy(**kwargs)


def register(registry: Any) -> None:
    if NAME not in registry:
        registry.register(NAME, megatron_strategy, description=DESCRIPTION)


class _RunAfter(importlib.abc.Loader):
    """The registry module's own loader, then ``register``."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        register(module.StrategyRegistry)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)   # one shot
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _RunAfter(spec.loader)
        return spec


def register_when_lightning_loads() -> None:
    module = sys.modules.get(REGISTRY_MODULE)
    if module is not None and hasattr(module, "StrategyRegistry"):
        register(module.StrategyRegistry)
    elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
