"""decode_tma's wgmma tile (catalogue `warpgroups`, `min_rows`): the catalogue and codegen carry it (name, template,
dispatch row, rules), and the runtime gives it exactly the calls with at least min_rows packed rows per kv head
(seqlen_q x nhead_q / nhead_k) and the mma.sync tile every other call, through the real C ABI of a library whose
split-KV instances are host stubs (built with nvcc, no GPU: kernel_name launches nothing)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from codegen import profiles, render, rules
from codegen.spec import Algorithm, KernelSpec
from test_capi_validation_splitkv import valid_args
from test_tile_choice import _stub_library

CSRC = Path(__file__).resolve().parent.parent / "csrc"

PREFIX = "splitkv_d128_bf16_batch_mask_sm90a_decode_tma_"


def d128_bf16_specs():
    return [s for s in profiles.select("fwd", "sm_90a", "default", PREFIX).specs]


def wgmma_specs() -> dict[int, KernelSpec]:
    """The bucket's wgmma tiles by their warpgroups."""
    return {dict(s.algorithm.tile)["warpgroups"]: s for s in d128_bf16_specs()
            if "warpgroups" in dict(s.algorithm.tile)}


def wgmma_spec(warpgroups: int = 1) -> KernelSpec:
    return wgmma_specs()[warpgroups]


def min_rows(warpgroups: int = 1) -> int:
    return dict(wgmma_spec(warpgroups).algorithm.tile)["min_rows"]


class TestCatalogue:
    def test_the_d128_bucket_has_two_wgmma_tiles_beside_the_mma_sync_one(self):
        names = sorted(s.name for s in d128_bf16_specs())
        assert names == [PREFIX + "b128x64g2", PREFIX + "b32x64w4", PREFIX + "b64x64g1"], names
        one, two = dict(wgmma_spec(1).algorithm.tile), dict(wgmma_spec(2).algorithm.tile)
        assert one["block_m"] == 64 and one["min_rows"] == 64
        assert two["block_m"] == 128 and two["min_rows"] == 128

    def test_the_template_and_the_dispatch_row(self):
        spec = wgmma_spec()
        src = render.render_instance(spec)
        assert '#include "kernels/decode/fmha_fwd_splitkv_wgmma.cuh"' in src
        assert "decode::SplitkvWgmmaKernel<MHAKIT_DTYPE_BF16, 128, 128, /*warpgroups=*/1," in src
        assert "SplitkvTmaKernel" not in src
        assert "/*warpgroups=*/2," in render.render_instance(wgmma_spec(2))
        # one block at a time unless the tile says overlap = 1 (no chosen tile does: the two-warpgroup pipelined loop
        # failed on the H200 and the kernel refuses it)
        assert "/*overlap=*/false>;" in src and "/*overlap=*/false>;" in render.render_instance(wgmma_spec(2))
        table = render.render_dispatch("fwd", "sm_90a", d128_bf16_specs())
        assert f"/*min_rows=*/{min_rows(1)}," in table and f"/*min_rows=*/{min_rows(2)}," in table
        assert "/*min_rows=*/0," in table

    @pytest.mark.parametrize("tile, message", [
        (dict(block_m=64, block_n=64, warpgroups=3, stages=3), "1 or 2 warpgroups"),
        (dict(block_m=128, block_n=64, warpgroups=1, stages=3), "block_m = 64 x warpgroups"),
        (dict(block_m=64, block_n=128, warpgroups=1, stages=3), "block_n = 64"),
        (dict(block_m=64, block_n=64, warpgroups=1, warps=4, stages=3), "no warps"),
        (dict(block_m=64, block_n=64, warpgroups=1, stages=3, min_rows=0), r"min_rows must be in \[1, 99999\]"),
        (dict(block_m=64, block_n=64, warpgroups=1, stages=3, overlap=2), r"overlap is 0 or 1"),
        (dict(block_m=128, block_n=64, warpgroups=2, stages=6, overlap=1), r"overlap = 1 with two warpgroups"),
    ])
    def test_the_rule_refuses_inconsistent_wgmma_tiles(self, tile, message):
        good = wgmma_spec()
        spec = KernelSpec(good.signature, Algorithm("decode_tma", "sm_90a", tuple(tile.items())), good.priority,
                          good.template, good.guards)
        reasons = rules.violations(spec)
        assert any(re.search(message, r) for r in reasons), reasons
        assert rules.violations(good) == [] and rules.violations(wgmma_spec(2)) == []


# ------------------------------------------------------------------------------------------------------------------
# The runtime's choice through mhakit_mha_fwd_splitkv_kernel_name, host stubs for the instances
# ------------------------------------------------------------------------------------------------------------------

def _args(sq, hq, hk, d=128):
    return valid_args(b=2, hq=hq, hk=hk, sq=sq, d=d)


@pytest.fixture(scope="module")
def stub_lib(tmp_path_factory):
    from mhakit import _capi
    return _capi.load_library(_stub_library(d128_bf16_specs(), tmp_path_factory.mktemp("decwg") / "full"))


@pytest.mark.compile
class TestRuntimeChoice:
    @pytest.mark.parametrize("sq, hq, hk", [(1, 32, 8), (4, 32, 8), (16, 8, 8), (8, 32, 8), (16, 24, 8), (2, 8, 1),
                                            (16, 32, 8), (16, 64, 8), (8, 64, 8), (1, 64, 1), (64, 8, 8),
                                            (4, 128, 8), (12, 64, 8), (32, 64, 8), (127, 8, 8)])
    def test_packed_rows_pick_the_tile(self, stub_lib, sq, hq, hk):
        """Below the one-warpgroup tile's min_rows the mma.sync tile; from it the wgmma tile with the largest
        min_rows the call meets."""
        rows = sq * hq // hk
        want = (wgmma_spec(2).name if rows >= min_rows(2) else wgmma_spec(1).name if rows >= min_rows(1)
                else PREFIX + "b32x64w4")
        assert stub_lib.splitkv_kernel_name(_args(sq, hq, hk)) == want, stub_lib.last_error()

    def test_the_wgmma_tile_alone_serves_every_call(self, tmp_path):
        from mhakit import _capi
        lib = _capi.load_library(_stub_library([wgmma_spec()], tmp_path / "wgmma_only"))
        for sq, hq, hk in [(1, 8, 8), (16, 32, 8)]:
            assert lib.splitkv_kernel_name(_args(sq, hq, hk)) == wgmma_spec().name, lib.last_error()

    def test_a_smaller_head_dim_keeps_the_tightest_bucket(self, tmp_path):
        """d64 calls with 64 packed rows go to the d64 mma.sync instance (the tightest bucket outranks min_rows)."""
        from mhakit import _capi
        specs = profiles.select("fwd", "sm_90a", "default", "splitkv_d64_bf16_batch_mask_sm90a_decode_tma_,"
                                + PREFIX).specs
        lib = _capi.load_library(_stub_library(specs, tmp_path / "d64"))
        name = lib.splitkv_kernel_name(_args(16, 32, 8, d=64))
        assert name is not None and name.startswith("splitkv_d64_bf16_batch_mask_sm90a_decode_tma_b"), name


# ------------------------------------------------------------------------------------------------------------------
# The kernel's shared-memory matrix descriptors against CuTe's make_gmma_desc for the same layouts (nvcc to PTX, no GPU)
# ------------------------------------------------------------------------------------------------------------------

DESC_PROGRAM = r"""
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include "kernels/decode/fmha_fwd_splitkv_wgmma.cuh"
using namespace cute;
using T = cutlass::bfloat16_t;
__global__ void descriptors(uint64_t* out) {
    __shared__ alignas(1024) T smem[64 * 128 * 2];
    // The ring's V block (64 keys x 128 columns: two 64-column boxes of 64 rows x 128 bytes, SW128) as the B operand
    // of O = P.V: (N = head dim, K = keys), one k step = 16 keys. Element (n, k) at (n / 64) x 4096 + k x 64 + n % 64.
    using VL = Layout<Shape<Shape<_64, _2>, Shape<_8, _2>>, Stride<Stride<_1, _4096>, Stride<_64, _512>>>;
    auto vt = make_tensor(make_smem_ptr(smem), ComposedLayout<Swizzle<3, 4, 3>, smem_ptr_flag_bits<16>, VL>{});
    // The K block's first box as the B operand of S = Q.K^T: (N = 64 keys, K = 16 columns), element (n, k) at n x 64 + k.
    using KL = Layout<Shape<Shape<_8, _8>, _16>, Stride<Stride<_64, _512>, _1>>;
    auto kt = make_tensor(make_smem_ptr(smem), ComposedLayout<Swizzle<3, 4, 3>, smem_ptr_flag_bits<16>, KL>{});
    // CuTe's descriptors OR the runtime shared address into constant fields: out[0], out[1] hold those fields at
    // address 0 minus the address; the kernel's own at address 0 are plain constants.
    const uint64_t addr = uint64_t(cast_smem_ptr_to_uint(smem)) >> 4;
    out[0] = SM90::GMMA::make_gmma_desc<SM90::GMMA::Major::MN>(vt).desc_ ^ addr;
    out[1] = SM90::GMMA::make_gmma_desc<SM90::GMMA::Major::K>(kt).desc_ ^ addr;
    out[2] = mhakit::decode::wgmma_detail::v_desc<64 * 128>(0u, 0);
    out[3] = mhakit::decode::wgmma_detail::k_desc<64 * 128>(0u, 0);
}
"""


@pytest.mark.compile
def test_descriptors_match_cute(tmp_path):
    """v_desc / k_desc (128-byte swizzle, MN-major V with the box stride as LBO, K-major K, 8-row groups 1024 bytes
    apart) encode what CuTe's make_gmma_desc encodes for the ring's V and K layouts."""
    import cutlass_library
    cutlass_include = Path(cutlass_library.__file__).parent / "source" / "include"
    src = tmp_path / "desc.cu"
    src.write_text(DESC_PROGRAM)
    ptx = tmp_path / "desc.ptx"
    cmd = ["nvcc", "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", f"-I{CSRC}", f"-I{CSRC / 'include'}",
           f"-I{cutlass_include}", "-ptx", str(src), "-o", str(ptx)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    text = ptx.read_text()
    # Every 64-bit constant with the layout type in bits 62-63: CuTe's two (xor'd with the address at run time) and
    # the kernel's two (stored as constants) must be the same two values.
    consts = [int(c) for c in re.findall(r"\b(\d{18,20})\b", text) if int(c) >> 62 == 1]
    assert len(set(consts)) == 2 and len(consts) >= 4, consts
    for c in set(consts):
        lbo, sbo = ((c >> 16) & 0x3FFF) * 16, ((c >> 32) & 0x3FFF) * 16
        assert (lbo, sbo) in {(64 * 128, 1024), (16, 1024)}, (lbo, sbo)
