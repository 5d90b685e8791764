"""What the Hopper kernels stage of an elementwise bias (csrc/kernels/hopper/hopper_bias_stage.hpp): the one rule,
bias_stageable, on aiter's bias layouts (-bias=e / e:1 / e:2 of benchmark_mha_fwd: [1|b, 1|h, s_q, s_k] with row
stride s_k) and the layouts it refuses, the TMA rings' sizes (two 8 KB swizzled boxes per 64 x 128 slot; forward: one
stage at d128 and d256 (whose K/V ring gives up a slot for it), two at d96; backward: two at d64 / d96 / d192, one at
d128, one 8 KB box per slot of the 64-key query split, none at d256, none in plain instances), through a host program
built with nvcc (no GPU)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from codegen import toolchain

CSRC = Path(__file__).resolve().parent.parent / "csrc"

PROGRAM = r"""
#include <cstdio>
#include "kernels/hopper/fmha_hopper_kernel.hpp"
#include "kernels/hopper/fmha_bwd_hopper_kernel.hpp"

using namespace mhakit;
using namespace mhakit::hopper;

static ScoreMods mods(int type, bool fp32, uintptr_t ptr, long long row, long long head, long long batch) {
    ScoreMods m{};
    m.bias_type = type;
    m.bias_fp32 = fp32;
    m.bias = reinterpret_cast<const void*>(ptr);
    m.bias_row_stride = row, m.bias_head_stride = head, m.bias_batch_stride = batch;
    return m;
}

template <int kHdim, int kBlockN = 128, bool kMods = true>
using Fwd =
    HopperFwdKernelBody<cutlass::bfloat16_t, cutlass::bfloat16_t, kHdim, kHdim, false, true, 128, kBlockN, kMods>;

template <int kHdim, int kHdimV, int kBlockN, bool kMods = true>
using Bwd = HopperBwdKernelBody<cutlass::bfloat16_t, kHdim, kHdimV, false, true, 64, kBlockN, kMods>;

template <class B>
static void bwd_facts(const char* name) {
    std::printf("%s_stages %d\n", name, B::kBiasStages);
    std::printf("%s_slot_bytes %d\n", name, B::Bias::kSlotBytes);
    std::printf("%s_smem_fits %d\n", name, int(B::SharedStorageSize <= B::kSmemLimit));
    std::printf("%s_stage_q %d\n", name, B::kStagesQ);
    std::printf("%s_stage_do %d\n", name, B::kStagesDO);
}

int main() {
    const uintptr_t p = 0x7f0000000000ull;
    const long long s = 1000, h = 16;  // s_k = 1000: 2000-byte rows
    std::printf("e %d\n", bias_stageable(mods(1, false, p, s, 0, 0)));
    std::printf("e:1 %d\n", bias_stageable(mods(1, false, p, s, s * s, 0)));
    std::printf("e:2 %d\n", bias_stageable(mods(1, false, p, s, s * s, h * s * s)));
    std::printf("odd_sk %d\n", bias_stageable(mods(1, false, p, 4092, 4092 * 4092, 0)));
    std::printf("odd_head %d\n", bias_stageable(mods(1, false, p, s, s * s + 4, 0)));
    std::printf("odd_batch %d\n", bias_stageable(mods(1, false, p, s, 0, 12)));
    std::printf("fp32 %d\n", bias_stageable(mods(1, true, p, s, 0, 0)));
    std::printf("alibi %d\n", bias_stageable(mods(2, true, p, 0, 1, 0)));
    std::printf("pointer %d\n", bias_stageable(mods(1, false, p + 8, s, 0, 0)));
    std::printf("row_broadcast %d\n", bias_stageable(mods(1, false, p, 0, s, 0)));
    std::printf("huge_stride %d\n", bias_stageable(mods(1, false, p, s, 0, 1ll << 40)));
    using F128 = Fwd<128>;
    using F96 = Fwd<96>;
    std::printf("d128_stages %d\n", F128::kBiasStages);
    std::printf("d96_stages %d\n", F96::kBiasStages);
    std::printf("slot_bytes %d\n", F128::Bias::kSlotBytes);
    std::printf("box_bytes %d\n", F128::Bias::kBoxBytes);
    std::printf("smem_fits %d\n", int(F128::SharedStorageSize <= F128::kSmemLimit));
    std::printf("d128_kv_stages %d\n", F128::kStages);
    std::printf("d256_stages %d\n", Fwd<256, 64>::kBiasStages);
    std::printf("d256_kv_stages %d\n", Fwd<256, 64>::kStages);
    std::printf("d256_plain_kv_stages %d\n", Fwd<256, 64, false>::kStages);
    std::printf("d256_smem_fits %d\n", int(Fwd<256, 64>::SharedStorageSize <= Fwd<256, 64>::kSmemLimit));
    bwd_facts<Bwd<64, 64, 128>>("bwd64");
    bwd_facts<Bwd<96, 96, 128>>("bwd96");
    bwd_facts<Bwd<128, 128, 128>>("bwd128");
    bwd_facts<Bwd<192, 192, 64>>("bwd192");
    bwd_facts<Bwd<192, 128, 64>>("bwd192x128");
    bwd_facts<Bwd<256, 256, 64>>("bwd256");
    bwd_facts<Bwd<128, 128, 128, false>>("bwd128plain");
    std::printf("bwd128plain_size_same %d\n",
                int(Bwd<128, 128, 128, false>::SharedStorageSize == sizeof(Bwd<128, 128, 128, true>::SharedStoragePlain)));
    return 0;
}
"""


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict[str, int]:
    out = tmp_path_factory.mktemp("bias_stage")
    (out / "rule.cu").write_text(PROGRAM)
    cutlass = toolchain.find_cutlass()
    cmd = [toolchain.locate_nvcc(), "-std=c++17", "--expt-relaxed-constexpr", "-arch=sm_90a", f"-I{CSRC}",
           f"-I{CSRC / 'include'}", f"-I{cutlass / 'include'}", f"-I{cutlass / 'tools' / 'util' / 'include'}",
           f"-I{cutlass / 'examples'}", str(out / "rule.cu"), "-o", str(out / "rule")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    run = subprocess.run([str(out / "rule")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return {k: int(v) for k, v in (line.split() for line in run.stdout.splitlines())}


@pytest.mark.compile
@pytest.mark.parametrize("layout, staged", [("e", 1), ("e:1", 1), ("e:2", 1), ("odd_sk", 0), ("odd_head", 0),
                                            ("odd_batch", 0), ("fp32", 0), ("alibi", 0), ("pointer", 0),
                                            ("row_broadcast", 0), ("huge_stride", 0)])
def test_bias_stageable(facts, layout, staged):
    assert facts[layout] == staged


@pytest.mark.compile
def test_forward_ring_is_tma_boxes(facts):
    """d128: one stage (a second would cost a K/V ring slot), d96: two; a 64 x 128 slot is two 64 x 64 boxes of
    128-byte rows with the 128-byte swizzle."""
    assert facts["d128_stages"] == 1 and facts["d96_stages"] == 2
    assert facts["box_bytes"] == 64 * 128 and facts["slot_bytes"] == 2 * 64 * 128
    assert facts["smem_fits"] == 1


@pytest.mark.compile
def test_forward_d256_ring_takes_a_kv_slot(facts):
    """d256 (128 x 64 tiles): one bias stage reserved before the K/V ring, which keeps 4 slots of the plain
    instance's 5; d128 keeps its 5."""
    assert facts["d256_stages"] == 1 and facts["d256_kv_stages"] == 4 and facts["d256_plain_kv_stages"] == 5
    assert facts["d256_smem_fits"] == 1 and facts["d128_kv_stages"] == 5


@pytest.mark.compile
@pytest.mark.parametrize("name, stages, slot", [("bwd64", 2, 2 * 8192), ("bwd96", 2, 2 * 8192),
                                                ("bwd128", 1, 2 * 8192), ("bwd192", 2, 8192),
                                                ("bwd192x128", 2, 8192), ("bwd256", 0, 8192)])
def test_backward_ring_is_tma_boxes(facts, name, stages, slot):
    """The backward's ring: the forward's TMA boxes (64 keys x 64 query rows, 8 KB), kBlockN / 64 per slot, as many
    stages (up to 2) as the shared memory leaves with 16 KB left to L1 for the second: d128 one (a second would fit at
    exactly the limit), still with two Q and two dO stages; d256 none."""
    assert facts[f"{name}_stages"] == stages
    assert facts[f"{name}_slot_bytes"] == slot
    assert facts[f"{name}_smem_fits"] == 1
    assert facts[f"{name}_stage_q"] == 2
    assert facts["bwd128_stage_do"] == 2


@pytest.mark.compile
def test_backward_plain_has_no_ring(facts):
    """Plain backward instances keep their shared storage (no ring, no tensor map)."""
    assert facts["bwd128plain_stages"] == 0 and facts["bwd128plain_size_same"] == 1
