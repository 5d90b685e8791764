"""The Hopper kernels write their 16-bit shared-memory tiles with stmatrix, never with generic stores: the PTX of one
instance per layout that stages a tile (backward key split, query split and swapped key split; the forward's staged
O) holds `stmatrix` and no store without a state space; and the forward's O leaves shared memory by the store its
tile takes (a TMA store or the threads' own).

Why a test: assigning elements through a swizzled CuTe shared-memory tensor compiles to one generic 64-bit store
per element pair (CuTe swizzles the pointer through its integer value, so nvcc loses the shared state space). The
d64 backward ran 16 of them per thread and tile until store_fragment_stsm (csrc/kernels/hopper/hopper_tile_io.hpp)
replaced them, and became 1.4-6.4 % faster (docs/PERFORMANCE.md, tenth session). The pattern compiles and runs
correctly, so only the generated code shows it coming back. PTX only (no ptxas): seconds per instance, no GPU."""
from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from codegen import catalogue, toolchain
from codegen.profiles import select
from codegen.render import render_instance

ARCH = "sm_90a"
# (api, instance): the layouts whose tiles the consumers store from registers into swizzled shared memory
INSTANCES = [
    ("bwd", "bwd_d64_bf16_batch_nmask_sm90a_hopper_b64x128"),     # key split: dSᵀ
    ("bwd", "bwd_d256_bf16_batch_nmask_sm90a_hopper_b64x64"),     # query split: Pᵀ and dSᵀ
    ("bwd", "bwd_d192x128_bf16_batch_mask_sm90a_hopper_b64x96"),  # swapped key split: P and dS
    ("fwd", "fwd_d128_bf16_batch_mask_sm90a_hopper_b128x128"),    # the forward's O, in a buffer of its own
    ("fwd", "fwd_d64_bf16_group_mask_sm90a_hopper_b128x128"),     # the forward's O, staged in the Q buffer
]
# The forward's O, staged in shared memory, leaves it by one TMA store per warpgroup and tile where the persistent
# tile has a swizzled buffer of its own for it (HopperFwdKernelBody::kTmaStoreO), else by the threads' 16-byte
# global stores.
O_STORES = [("fwd_d128_bf16_batch_mask_sm90a_hopper_b128x128", True),
            ("fwd_d64_bf16_group_mask_sm90a_hopper_b128x128", False)]
TMA_STORE = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")
# a store instruction with no state space: st[.weak|.volatile|.relaxed...].<type or vector>
GENERIC_STORE = re.compile(r"^\s*(@!?%p\d+\s+)?st(\.(weak|volatile|relaxed\.\w+|release\.\w+))?\.(v[248]\.)?[bsuf]\d+\s",
                           re.M)


def _ptx(nvcc, api: str, name: str, out) -> str:
    specs = [s for s in select(api, ARCH, "default", name).specs if s.name == name]
    assert len(specs) == 1, f"{name}: not an instance of the default profile (the catalogue changed?)"
    src = out / f"{name}.cu"
    src.write_text(render_instance(specs[0]))
    cmd = [nvcc.path, *nvcc.compile_flags(), "-ptx", str(src), "-o", str(out / f"{name}.ptx")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return (out / f"{name}.ptx").read_text()


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("smem_stores")
    nvcc = toolchain.make_toolchain(ARCH, catalogue.load().arch(ARCH).gencode)
    with ThreadPoolExecutor(max_workers=2) as pool:
        texts = pool.map(lambda inst: _ptx(nvcc, *inst, out), INSTANCES)
        return {name: text for (_, name), text in zip(INSTANCES, texts)}


@pytest.mark.compile
@pytest.mark.parametrize("name", [name for _, name in INSTANCES])
def test_tiles_go_to_shared_memory_with_stmatrix(ptx, name):
    generic = GENERIC_STORE.findall(ptx[name])
    assert not generic, f"{name}: {len(generic)} generic stores in the PTX (an element-wise store through a swizzled " \
                        "shared-memory tensor? use store_fragment_stsm)"
    assert "stmatrix.sync.aligned.x4.m8n8.shared.b16" in ptx[name], f"{name}: no stmatrix in the PTX"


def test_the_pattern_sees_generic_stores_only():
    """The regex on the forms it must catch and those it must leave: a stored state space is not generic."""
    caught = ["\tst.u32 \t[%rd1], %r2;", "\t@%p3 st.v2.f32 \t[%rd4], {%f1, %f2};", "\tst.b32 [%rd1], %r1;"]
    left = ["\tst.shared.u32 \t[%r1], %r2;", "\tst.global.v4.u32 \t[%rd1], {%r1, %r2, %r3, %r4};",
            "\tst.param.b32 \t[retval0], %r1;", "\tst.local.u32 [%rd1], %r1;"]
    assert all(GENERIC_STORE.search(line + "\n") for line in caught)
    assert not any(GENERIC_STORE.search(line + "\n") for line in left)


@pytest.mark.compile
@pytest.mark.parametrize("name, tma", O_STORES)
def test_the_forward_o_leaves_by_its_tiles_store(ptx, name, tma):
    text = ptx[name]
    assert bool(TMA_STORE.search(text)) == tma, f"{name}: a TMA store of O {'missing' if tma else 'present'}"
    if tma:  # the buffer is rewritten only after the store has read it, and the CTA exits after the last one has
        assert "cp.async.bulk.commit_group" in text and "cp.async.bulk.wait_group.read 0" in text
    else:
        assert re.search(r"st\.global\.v4\.(u|b)32", text), f"{name}: no 16-byte global store of O"
