"""mhakit.mha_fwd_kvcache on a machine without a GPU: its argument checks and their messages (fake CUDA arrays,
through both call paths), an empty call that needs no library, and the Python path reaching the real library
(built for the fake device) with every argument accepted."""
from __future__ import annotations

import pytest

import mhakit
from conftest import have_gpu, have_nvcc
from mhakit import jit
from mhakit._arrays import DeviceArray, dtype_by_name
from test_python_api import install_fake_driver


def arr(shape, dtype="float16", strides=None, device=0, ptr=0x7F0000000000):
    return DeviceArray(ptr, shape, dtype_by_name(dtype), device, strides=strides)


def call(**over):
    """Keyword arguments of a valid decode call: b=2, s_q=1, 8 query heads over 2 kv heads, a [2, 64, 2, 128]
    contiguous cache, device cache_seqlens."""
    args = dict(q=arr((2, 1, 8, 128)), k_cache=arr((2, 64, 2, 128)), v_cache=arr((2, 64, 2, 128)),
                cache_seqlens=arr((2,), "int32"))
    args.update(over)
    return args


@pytest.mark.usefixtures("call_path")
class TestKvcacheArguments:
    @pytest.mark.parametrize("over, error, message", [
        (dict(q=arr((2, 8, 128))), ValueError, r"q: expected 4 dims \[batch, seqlen_q, nheads, headdim\]"),
        (dict(k_cache=arr((2, 64, 2, 64))), ValueError, "k_cache: head dim 64 does not match q's head dim 128"),
        (dict(v_cache=arr((2, 63, 2, 128))), ValueError, "v_cache: shape .* does not match k_cache's"),
        (dict(k_cache=arr((2, 64, 3, 128)), v_cache=arr((2, 64, 3, 128))), ValueError,
         "k_cache: 3 kv heads; q's head count 8 must be a positive multiple of it"),
        (dict(k_cache=arr((3, 64, 2, 128)), v_cache=arr((3, 64, 2, 128))), ValueError,
         "k_cache: batch 3 does not match q's batch 2"),
        (dict(q=arr((2, 1, 8, 300)), k_cache=arr((2, 64, 2, 300)), v_cache=arr((2, 64, 2, 300))), ValueError,
         r"q: head dim 300 is not supported"),
        (dict(v_cache=arr((2, 64, 2, 128), "bfloat16")), TypeError, "v_cache: dtype bfloat16 does not match"),
        (dict(cache_seqlens=arr((3,), "int32")), ValueError, r"cache_seqlens: expected shape \(2,\)"),
        (dict(cache_seqlens=arr((2,), "int64")), TypeError, "cache_seqlens: expected dtype int32"),
        (dict(cache_seqlens=[3, 70]), ValueError, "cache_seqlens: each batch's cache rows plus the 0 new ones must "
                                                  "fit the cache's 64 rows"),
        (dict(cache_seqlens=[1, 2, 3]), ValueError, "cache_seqlens: expected 2 integers"),
        (dict(block_table=arr((2, 4), "int64")), TypeError, "block_table: expected dtype int32"),
        (dict(block_table=arr((3, 4), "int32")), ValueError, r"block_table: expected shape \(2, max_blocks\)"),
        (dict(block_table=arr((2, 4), "int32"), cache_batch_idx=arr((2,), "int32")), ValueError,
         "cache_batch_idx: works with contiguous caches only"),
        (dict(cache_batch_idx=[0, 5]), ValueError, r"cache_batch_idx: entries must be in \[0, 2\)"),
        (dict(k=arr((2, 1, 2, 128))), ValueError, "k / v: give both new keys and new values, or neither"),
        (dict(k=arr((2, 1, 2, 128)), v=arr((2, 2, 2, 128))), ValueError, r"v: expected shape \(2, 1, 2, 128\)"),
        (dict(num_splits=129), ValueError, r"num_splits: must be 0 \(chosen from the GPU\) or in \[1, 128\]"),
        (dict(num_splits=-1), ValueError, "num_splits: must be 0"),
        (dict(window=3), TypeError, r"window: expected \(left, right\)"),
        (dict(scale=0.0), ValueError, "scale: must be finite and > 0"),
        (dict(return_lse="yes"), TypeError, "return_lse: expected a bool"),
        (dict(out=arr((2, 1, 8, 64))), ValueError, r"out: expected shape \(2, 1, 8, 128\)"),
        (dict(lse_out=arr((2, 8, 1), "float16")), TypeError, "lse_out: expected dtype float32"),
        (dict(dtype="bf16"), TypeError, "q: has dtype float16 but dtype='bf16' was given"),
    ])
    def test_errors_name_the_argument(self, over, error, message):
        with pytest.raises(error, match=message):
            mhakit.mha_fwd_kvcache(**call(**over))

    def test_empty_batch_needs_no_library(self, monkeypatch):
        monkeypatch.setattr(jit, "library", lambda *a, **k: pytest.fail("no library for an empty call"))
        from mhakit import _cuda
        monkeypatch.setattr(_cuda, "allocate", lambda nbytes, dev, stream, ref=None: _cuda.Allocation(
            0, 0, dev, stream, ref, False))
        o, lse = mhakit.mha_fwd_kvcache(**call(q=arr((0, 1, 8, 128)), k_cache=arr((0, 64, 2, 128)),
                                              v_cache=arr((0, 64, 2, 128)), cache_seqlens=arr((0,), "int32")),
                                        return_lse=True)
        assert o.shape == (0, 1, 8, 128) and lse.shape == (0, 8, 1)


@pytest.mark.skipif(have_gpu(), reason="checks the message on machines without a GPU")
@pytest.mark.usefixtures("call_path")
def test_kvcache_call_without_gpu_says_so():
    with pytest.raises(mhakit.CudaUnavailableError, match="no usable NVIDIA GPU in this process"):
        mhakit.mha_fwd_kvcache(**call())


def test_python_path_reaches_the_library_with_valid_arguments(tmp_path, monkeypatch, python_path):
    """With a fake driver, a paged call with appended rows, GQA, a host cache_seqlens and forced splits builds the
    decode library for the fake device's arch (sm_80), uploads the lengths, asks the library for the accumulator
    sizes, allocates them on the call's stream, and the library accepts every argument up to its device check."""
    from mhakit import _capi
    if not have_nvcc():
        pytest.skip("nvcc not found")
    if have_gpu():
        pytest.skip("the GPU tests cover this path for real")
    fake = install_fake_driver(monkeypatch, tmp_path)
    q = arr((2, 4, 8, 64))
    kc, vc = arr((9, 16, 2, 64)), arr((9, 16, 2, 64))
    kn, vn = arr((2, 3, 2, 64)), arr((2, 3, 2, 64))
    with pytest.raises(_capi.MhakitError, match="no CUDA device/driver is available") as info:
        mhakit.mha_fwd_kvcache(q, kc, vc, [20, 0], block_table=arr((2, 4), "int32"), k=kn, v=vn, causal=True,
                               num_splits=3, return_lse=True, stream=0x5000)
    assert info.value.code == _capi.ERROR_CUDA
    allocs = [c[1] for c in fake.calls if c[0] == "cuMemAllocAsync"]
    assert allocs[:3] == [(2 * 4 * 8 * 64 * 2, 0x5000), (2 * 8 * 4 * 4, 0x5000), (2 * 4, 0x5000)]  # O, LSE, lengths
    lse_acc = 3 * 2 * 8 * 4 * 4  # splits x batch x heads x rows, fp32; o_acc: x hdim_v
    assert allocs[3:] == [(lse_acc, 0x5000), (lse_acc * 64, 0x5000)]
    uploads = [c[1] for c in fake.calls if c[0] == "cuMemcpyHtoDAsync"]
    assert [u[2] for u in uploads] == [8]
    names = [d.name.split("-")[0:2] for d in (tmp_path / "cache" / "v1" / "fwd").iterdir()]
    assert names == [["fwd_fp16_batch_mask_sm80", "decode_d64"]]
