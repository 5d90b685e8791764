"""mhakit: a torch-free JIT build toolkit for fused multi-head attention.

Importing the package is cheap and needs only the standard library: submodules are loaded on first attribute
access (PEP 562), so ``import mhakit`` works on a machine without a GPU, without torch, even without numpy.

    import mhakit
    mhakit.reference.attention_fwd(q, k, v, mask_type=1)   # loads mhakit.reference (numpy) on first use
    mhakit._capi.load_library("./libmha_fwd.so")           # ctypes mirror of csrc/include/mha_fwd.h
"""

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

# Submodules reachable as attributes of the package without an explicit import. Other public submodules added
# later are found too (see __getattr__); this tuple only feeds dir() and documents what exists today.
_LAZY_SUBMODULES = ("reference", "_capi")

__all__ = ["__version__", "reference"]


def __getattr__(name: str):
    # Only submodule names are resolved here; dunder lookups (e.g. __path__ probes) must fail fast.
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _LAZY_SUBMODULES or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module  # later lookups bypass __getattr__
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
