"""Names a package exports, imported on first use (PEP 562): ``import packer`` and the CLI's
inspection commands never import torch."""
from __future__ import annotations

from importlib import import_module
from typing import Callable, Dict, Iterable, Tuple


def lazy_names(package: str, where: Dict[str, Iterable[str]],
               namespace: dict) -> Tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``where`` maps each submodule to the names it
    provides; a name is imported once, then cached in ``namespace``."""
    home = {name: module for module, names in where.items() for name in names}

    def __getattr__(name: str):
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        found = import_module(module, package)  # a subpackage may list itself
        value = found if module == "." + name else getattr(found, name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace.get("__all__", ())) | set(home))

    return __getattr__, __dir__
