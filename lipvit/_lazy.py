"""Lazy public names for a package's ``__init__`` (PEP 562 module ``__getattr__``).

A package lists its public entry points as ``name -> module``; each is imported
the first time it is used, so ``import certify`` stays light and a public name
never hides a submodule of the same package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` resolving ``names[attr]`` on first access.

    Module names are relative to ``package`` (``".network"``), so a package
    keeps working when it is installed under another name.
    """

    def __getattr__(attr: str) -> Any:
        if attr not in names:
            raise AttributeError(f"module {package!r} has no attribute {attr!r}")
        return getattr(importlib.import_module(names[attr], package), attr)

    return __getattr__
