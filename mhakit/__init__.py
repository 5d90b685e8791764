"""mhakit: a torch-free JIT build toolkit for fused multi-head attention.

    import mhakit
    o = mhakit.mha_fwd(q, k, v, causal=True)              # CuPy / PyTorch / JAX arrays (DLPack or CUDA array interface)
                                                          # on NVIDIA GPUs, or DLPack arrays on AMD GPUs (ROCm)
    o, lse = mhakit.mha_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True)
    o, lse = mhakit.mha_fwd(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = mhakit.mha_bwd(do, q, k, v, o, lse, causal=True)   # gradients; mha_varlen_bwd: group mode
    o = mhakit.mha_fwd_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=bt, k=k_new, v=v_new, causal=True)
    mhakit.prebuild(profile="default")                    # fill the kernel cache ahead of time (also: python -m mhakit)
    mhakit.prebuild(profile="default", api="bwd")         # ... and for the backward
    mhakit.reference.attention_fwd(q, k, v, mask_type=1)   # the NumPy reference

Importing the package is cheap and needs only the standard library: everything is loaded on first attribute access
(PEP 562), so ``import mhakit`` works without a GPU, without torch, even without numpy, cuda-bindings or hip-python.
The first call of a configuration builds the kernels it needs with nvcc, or for an AMD GPU with hipcc/clang (once;
cached under ``mhakit.cache_dir()``, see mhakit.jit).
"""

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

# Public names -> the submodule that defines them (loaded on first access).
_LAZY_ATTRS = {
    "mha_fwd": "api",
    "mha_varlen_fwd": "api",
    "mha_fwd_kvcache": "api",
    "mha_bwd": "api",
    "mha_varlen_bwd": "api",
    "prebuild": "jit",
    "cache_dir": "jit",
    "DeviceArray": "_arrays",
    "MhakitError": "_capi",
    "CudaUnavailableError": "_cuda",
    "HipUnavailableError": "_hip",
    "DeviceUnavailableError": "_device",
    "JitError": "jit",
    "NoCompilerError": "jit",
}

# Submodules reachable as attributes of the package without an explicit import. Other public submodules added
# later are found too (see __getattr__); this tuple only feeds dir() and documents what exists today.
_LAZY_SUBMODULES = ("reference", "_capi", "api", "jit", "codegen")

__all__ = ["__version__", "reference", "mha_fwd", "mha_varlen_fwd", "mha_fwd_kvcache", "mha_bwd", "mha_varlen_bwd",
           "prebuild",
           "cache_dir", "DeviceArray", "MhakitError", "CudaUnavailableError", "HipUnavailableError",
           "DeviceUnavailableError", "JitError", "NoCompilerError"]


def __getattr__(name: str):
    # Only public names and submodule names are resolved here; dunder lookups (e.g. __path__ probes) must fail fast.
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _LAZY_ATTRS:
        value = getattr(importlib.import_module(f".{_LAZY_ATTRS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name == "codegen":  # the code generator: mhakit/codegen installed, <checkout>/codegen in place
        from . import _codegen
        return _codegen.load()
    if name in _LAZY_SUBMODULES or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module  # later lookups bypass __getattr__
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES) | set(_LAZY_ATTRS))
