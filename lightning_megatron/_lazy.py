"""Package faces that import on first use: ``import lightning_megatron.parallel.topology`` must not pay for
torch, and importing the package must not pay for Lightning (PEP 562 module ``__getattr__``)."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Mapping, Tuple


def lazy_face(package: str, exports: Mapping[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: each public name in ``exports`` maps to the module that
    defines it, relative to ``package`` (``".state"``, ``"..parallel.stages"``), imported when the name is first read."""
    table: Dict[str, str] = dict(exports)
    for name, module in table.items():   # importing that submodule would rebind the name to the module
        if module.lstrip(".") == name:
            raise ValueError(f"{package}: {name!r} is also a submodule's name; import it eagerly in the face")

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(importlib.import_module(package), name, value)   # the next read is a plain attribute
        return value

    def __dir__() -> List[str]:
        return sorted(set(table) | set(vars(importlib.import_module(package))))

    return __getattr__, __dir__
