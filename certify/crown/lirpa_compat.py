"""Import auto_LiRPA 0.3 on today's torch and numpy, patching only what is missing.

auto_LiRPA 0.3 (2022, the only release on PyPI) was written for torch < 1.13
and numpy 1.x. Four things it relies on have since changed; each fix below is
applied only when a feature check shows it is needed, so a newer auto_LiRPA or
an older torch is left untouched:

1. ``numpy.lib.arraysetops`` (imported by ``auto_LiRPA.operators.base`` for
   ``isin``) became private in numpy 2 (``numpy.lib._arraysetops_impl``).
   We register a tiny alias module exposing the public ``numpy.isin``.
2. ``torch.onnx.symbolic_helper._set_opset_version`` (called by
   ``auto_LiRPA.parse_graph`` before ONNX graph optimisation) is gone; the opset
   now lives in ``GLOBALS.export_onnx_opset_version`` of
   ``torch.onnx._internal.torchscript_exporter._globals``. We add a setter
   (auto_LiRPA sets opset 12 on every graph it parses, as it always did).
3. ``torch._C.Node.__getitem__`` (``node[name]`` for a polymorphic attribute,
   used by ``auto_LiRPA.parse_graph`` to read node attributes) was removed.
   Old torch defined it in ``torch.onnx.utils`` as ``kindOf`` plus the typed
   getter (``f``, ``i``, ``s``, ``t``, ``fs``, ``is``, ...); we restore exactly
   that (torch's own ``symbolic_helper._node_get`` does the same).
4. ``torch.nn.Module._named_members`` gained a ``remove_duplicate`` keyword
   (used by ``parameters()``/``buffers()``), which ``BoundedModule``'s override
   does not accept. We replace the override with one that accepts it and
   keeps auto_LiRPA's renaming of members to the original module's names.

The patches touch process-global objects (a module alias in ``sys.modules``, a
function in ``torch.onnx.symbolic_helper``, a method on ``torch._C.Node``, a
method of ``BoundedModule``); each only adds what is absent.

Install auto_LiRPA (and torchattacks, used by the tests) with
``pip install --no-deps -r requirements-nodeps.txt``: their metadata pins torch
< 1.13 and torchvision, which would downgrade or drag in packages we do not use.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
import types
import warnings
from typing import Any

import numpy as np
import torch

from lipvit.errors import LipvitError

INSTALL_HINT = (
    "auto_LiRPA is not installed; install it with "
    "`pip install --no-deps -r requirements-nodeps.txt` (see README)"
)

#: Names of the patches :func:`import_auto_lirpa` applied in this process.
APPLIED: list[str] = []


def _patch_numpy_arraysetops() -> None:
    """Alias ``numpy.lib.arraysetops`` (numpy ≥ 2 made it private) to ``isin``."""
    try:
        importlib.import_module("numpy.lib.arraysetops")
        return
    except ImportError:
        pass
    alias = types.ModuleType("numpy.lib.arraysetops")
    alias.isin = np.isin  # the only name auto_LiRPA imports from it
    sys.modules["numpy.lib.arraysetops"] = alias
    APPLIED.append("numpy.lib.arraysetops")


def _patch_onnx_opset_setter() -> None:
    """Restore ``torch.onnx.symbolic_helper._set_opset_version`` (gone in torch 2)."""
    symbolic_helper = importlib.import_module("torch.onnx.symbolic_helper")
    if hasattr(symbolic_helper, "_set_opset_version"):
        return
    from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

    def _set_opset_version(opset_version: int) -> None:
        GLOBALS.export_onnx_opset_version = opset_version

    symbolic_helper._set_opset_version = _set_opset_version
    APPLIED.append("torch.onnx.symbolic_helper._set_opset_version")


def _patch_node_getitem() -> None:
    """Restore ``torch._C.Node.__getitem__``: ``node[k]`` = typed getter of ``k``."""
    if hasattr(torch._C.Node, "__getitem__"):
        return

    def _node_getitem(node: torch._C.Node, key: str) -> Any:
        # kindOf gives the attribute's type tag ("f", "i", "s", "t", "fs", "is",
        # "ss", "ts", "g", "gs", "ty", "tys", "ival", ...), which is also the name
        # of the getter method for that type.
        return getattr(node, node.kindOf(key))(key)

    torch._C.Node.__getitem__ = _node_getitem
    APPLIED.append("torch._C.Node.__getitem__")


def _patch_named_members(lirpa: types.ModuleType) -> None:
    """Let ``BoundedModule._named_members`` take torch's ``remove_duplicate``."""
    bounded_module = lirpa.BoundedModule
    ours = inspect.signature(bounded_module._named_members).parameters
    torchs = inspect.signature(torch.nn.Module._named_members).parameters
    if "remove_duplicate" in ours or "remove_duplicate" not in torchs:
        return

    def _named_members(self, get_members_fn, prefix="", recurse=True,
                       remove_duplicate: bool = True):
        # torch's Module._named_members, plus auto_LiRPA's translation of the
        # bound graph's node names to the original module's parameter names.
        memo = set()
        modules = (self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate)
                   if recurse else [(prefix, self)])
        for module_prefix, module in modules:
            for k, v in get_members_fn(module):
                if v is None or v in memo:
                    continue
                if remove_duplicate:
                    memo.add(v)
                name = module_prefix + ("." if module_prefix else "") + k
                yield self.node_name_map.get(name, name), v

    bounded_module._named_members = _named_members
    APPLIED.append("BoundedModule._named_members")


def import_auto_lirpa() -> types.ModuleType:
    """Import ``auto_LiRPA`` with the compatibility patches above, and return it.

    Raises:
        LipvitError: auto_LiRPA is not installed (the message says how to
            install it) or fails to import even with the patches.
    """
    if importlib.util.find_spec("auto_LiRPA") is None:
        raise LipvitError(INSTALL_HINT)
    _patch_numpy_arraysetops()
    _patch_onnx_opset_setter()
    _patch_node_getitem()
    root = logging.getLogger()
    root_handlers = list(root.handlers)
    try:
        # auto_LiRPA's import calls warnings.simplefilter("once") (undone by
        # catch_warnings) and logging.basicConfig(stream=sys.stdout), which
        # would make the root logger print to stdout (undone below). Its
        # @torch.jit.script decorators raise torch's DeprecationWarning, which
        # we drop; other warnings are passed on.
        with warnings.catch_warnings(record=True) as caught:
            lirpa = importlib.import_module("auto_LiRPA")
        for w in caught:
            if not issubclass(w.category, DeprecationWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    except Exception as exc:  # any import-time incompatibility: report it in one line
        first_line = (str(exc).splitlines() or [""])[0]
        raise LipvitError(
            f"auto_LiRPA is installed but failed to import ({type(exc).__name__}: "
            f"{first_line}); lipvit supports auto_LiRPA 0.3 installed with "
            "`pip install --no-deps -r requirements-nodeps.txt`"
        ) from exc
    finally:
        root.handlers[:] = root_handlers
    _patch_named_members(lirpa)
    return lirpa


def auto_lirpa_available() -> bool:
    """Whether :func:`import_auto_lirpa` succeeds (for skipping optional tests)."""
    try:
        import_auto_lirpa()
    except LipvitError:
        return False
    return True
