"""A stand-in for hip-python's ``hip`` module (``from hip import hip``) on a machine without an AMD GPU: every call
is recorded and answers as the HIP runtime would for one device (gcnArchName given), handing out made-up device
addresses. Only mhakit's HIP device layer (mhakit._hip) talks to it; nothing runs on a GPU."""
from __future__ import annotations

import sys
import types


class FakeHip:
    class hipError_t:
        hipSuccess = 0
        hipErrorInvalidValue = 1

    class hipDeviceAttribute_t:
        hipDeviceAttributeMemoryPoolsSupported = 120

    hipEventDisableTiming = 2

    class Props:
        def __init__(self, name):
            self.gcnArchName = name

    def __init__(self, gcn_arch_name="gfx942:sramecc+:xnack-", devices=1):
        self.calls = []
        self.gcn_arch_name = gcn_arch_name
        self.devices = devices
        self.current = 0
        self.next_ptr = 0x7D0000000000

    def names(self):
        return [c[0] for c in self.calls]

    def __getattr__(self, name):
        if not name.startswith("hip"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, args))
            if name == "hipGetDeviceCount":
                return (0, self.devices)
            if name == "hipGetDeviceProperties":
                return (0, FakeHip.Props(self.gcn_arch_name))
            if name == "hipGetDevice":
                return (0, self.current)
            if name == "hipSetDevice":
                self.current = args[0]
                return (0,)
            if name == "hipDeviceGetAttribute":
                return (0, 1)
            if name in ("hipMallocAsync", "hipMalloc"):
                ptr, self.next_ptr = self.next_ptr, self.next_ptr + ((int(args[0]) + 255) // 256) * 256
                return (0, ptr)
            if name == "hipEventCreateWithFlags":
                return (0, 0xE0)
            if name in ("hipGetErrorName", "hipGetErrorString"):
                return (0, b"hipErrorInvalidValue")
            return (0,)
        return call


def install(monkeypatch=None, **kwargs) -> FakeHip:
    """Puts a FakeHip where ``from hip import hip`` finds it (through `monkeypatch` when given, so that it is undone
    after the test) and resets mhakit._hip's per-process state; returns it."""
    fake = FakeHip(**kwargs)
    package = types.ModuleType("hip")
    package.hip = fake
    from mhakit import _hip, jit
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, "hip", package)
        for module, memo in ((_hip, "_ARCH_NAMES"), (_hip, "_POOLS"), (jit, "_LIBS"), (jit, "_ARCHS")):
            monkeypatch.setattr(module, memo, {})
        monkeypatch.setattr(_hip, "_RUNTIME", None)
    else:
        sys.modules["hip"] = package
    return fake


class FakeLibrary:
    """What jit.library hands the Python call path, recording each launch: (function, args struct, stream config)."""

    def __init__(self, workspace=0):
        self.launches = []
        self.workspace = workspace

    def mha_fwd(self, args, config):
        self.launches.append(("mha_fwd", args, config))
        return 0.0

    def workspace_size(self, args):
        return self.workspace

    def mha_bwd(self, args, config):
        self.launches.append(("mha_bwd", args, config))
        return 0.0
