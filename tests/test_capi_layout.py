"""The ctypes mirrors in mhakit._capi must match the C structs of csrc/include/mha_fwd.h and mha_bwd.h byte for
byte.

A tiny C program, compiled with the system ``cc``, prints sizeof / offsetof / field sizes of every field; the
field names and their order are also read from the header text, so a field added, removed or reordered in the
header fails here until mhakit/_capi.py follows.
"""

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mhakit import _capi

REPO = Path(__file__).resolve().parents[1]
INCLUDE = REPO / "csrc" / "include"
STRUCTS = {
    "mhakit_fwd_args": (_capi.MhakitFwdArgs, INCLUDE / "mha_fwd.h"),
    "mhakit_fwd_splitkv_args": (_capi.MhakitFwdSplitkvArgs, INCLUDE / "mha_fwd.h"),
    "mhakit_bwd_args": (_capi.MhakitBwdArgs, INCLUDE / "mha_bwd.h"),
    "mhakit_stream_config": (_capi.MhakitStreamConfig, INCLUDE / "mha_common.h"),
}


def header_fields(header: Path, struct: str):
    """Field names of ``typedef struct <struct> { ... } <struct>;`` in declaration order."""
    text = header.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    m = re.search(r"typedef\s+struct\s+%s\s*\{(.*?)\}\s*%s\s*;" % (struct, struct), text, flags=re.S)
    assert m, f"struct {struct} not found in {header}"
    names = []
    for decl in m.group(1).split(";"):
        decl = decl.strip()
        if not decl:
            continue
        for i, part in enumerate(decl.split(",")):
            ident = re.findall(r"[A-Za-z_]\w*", part)
            assert ident, f"cannot parse declaration {decl!r}"
            names.append(ident[-1])
    return names


def test_field_names_and_order_match_header():
    for struct, (cls, header) in STRUCTS.items():
        assert [name for name, _ in cls._fields_] == header_fields(header, struct), struct


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no system C compiler (cc)")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "mha_fwd.h"', '#include "mha_bwd.h"',
             "int main(void) {"]
    for struct, (cls, _) in STRUCTS.items():
        lines.append(f'    printf("{struct} sizeof %zu %zu\\n", sizeof({struct}), (size_t)_Alignof({struct}));')
        for name, _ in cls._fields_:
            lines.append(f'    printf("{struct} {name} %zu %zu\\n", offsetof({struct}, {name}), '
                         f"sizeof((({struct}*)0)->{name}));")
    lines += ["    return 0;", "}"]
    work = tmp_path_factory.mktemp("capi_layout")
    src = work / "layout.c"
    exe = work / "layout"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", str(INCLUDE), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    layout = {}
    for line in out.splitlines():
        struct, name, a, b = line.split()
        layout[(struct, name)] = (int(a), int(b))
    return layout


@pytest.mark.parametrize("struct", sorted(STRUCTS))
def test_ctypes_layout_matches_c(c_layout, struct):
    cls, _ = STRUCTS[struct]
    size, align = c_layout[(struct, "sizeof")]
    assert ctypes.sizeof(cls) == size
    assert ctypes.alignment(cls) == align
    for name, ctype in cls._fields_:
        offset, fsize = c_layout[(struct, name)]
        assert getattr(cls, name).offset == offset, name
        assert ctypes.sizeof(ctype) == fsize, name


def test_strides_are_int64_and_pointers_void_p():
    for cls, scale in ((_capi.MhakitFwdArgs, "scale_s"), (_capi.MhakitBwdArgs, "scale")):
        fields = dict(cls._fields_)
        for name, ctype in fields.items():
            if "stride" in name:
                assert ctype is ctypes.c_int64, name
            if name.endswith("_ptr"):
                assert ctype is ctypes.c_void_p, name
        assert fields[scale] is ctypes.c_float
    assert dict(_capi.MhakitBwdArgs._fields_)["workspace_bytes"] is ctypes.c_size_t


def test_make_fwd_args_fills_every_field():
    # b·h·s·d for q/k/v/o, LSE [b, h, s]
    b, hq, hk, sq, sk, d, dv = 2, 8, 2, 128, 256, 64, 128
    a = _capi.make_fwd_args(
        dtype="bf16", q_ptr=0x1000, k_ptr=0x2000, v_ptr=0x3000, o_ptr=0x4000, lse_ptr=0x5000,
        batch=b, seqlen_q=sq, seqlen_k=sk, nhead_q=hq, nhead_k=hk, hdim_q=d, hdim_v=dv,
        q_strides=(hq * sq * d, sq * d, d), k_strides=(hk * sk * d, sk * d, d), v_strides=(hk * sk * dv, sk * dv, dv),
        o_strides=(hq * sq * dv, sq * dv, dv), lse_strides=(hq * sq, sq),
        mask_type=_capi.MASK_BOTTOM_RIGHT, window_left=-1, window_right=0)
    assert a.data_type == _capi.DTYPE_BF16 and a.is_group_mode == 0 and a.has_lse == 1
    assert (a.q_ptr, a.k_ptr, a.v_ptr, a.o_ptr, a.lse_ptr) == (0x1000, 0x2000, 0x3000, 0x4000, 0x5000)
    assert a.seqstart_q_ptr is None and a.seqstart_k_ptr is None
    assert (a.seqlen_q, a.seqlen_k, a.batch, a.max_seqlen_q) == (sq, sk, b, sq)
    assert (a.hdim_q, a.hdim_v, a.nhead_q, a.nhead_k) == (d, dv, hq, hk)
    assert a.scale_s == pytest.approx(1 / 8)
    assert (a.stride_q, a.stride_k, a.stride_v, a.stride_o) == (d, d, dv, dv)
    assert (a.nhead_stride_q, a.nhead_stride_k, a.nhead_stride_v, a.nhead_stride_o, a.nhead_stride_lse) == (
        sq * d, sk * d, sk * dv, sq * dv, sq)
    assert (a.batch_stride_q, a.batch_stride_k, a.batch_stride_v, a.batch_stride_o, a.batch_stride_lse) == (
        hq * sq * d, hk * sk * d, hk * sk * dv, hq * sq * dv, hq * sq)
    assert (a.mask_type, a.window_size_left, a.window_size_right) == (2, -1, 0)

    g = _capi.make_fwd_args(
        dtype="torch.float16", q_ptr=1, k_ptr=2, v_ptr=3, o_ptr=4, batch=3, nhead_q=4, nhead_k=4, hdim_q=128,
        hdim_v=128, q_strides=(0, 128, 512), k_strides=(0, 128, 512), v_strides=(0, 128, 512),
        o_strides=(0, 128, 512), seqstart_q_ptr=0x10, seqstart_k_ptr=0x20, max_seqlen_q=77, scale=0.5)
    assert g.data_type == _capi.DTYPE_FP16 and g.is_group_mode == 1 and g.has_lse == 0 and g.lse_ptr is None
    assert (g.seqstart_q_ptr, g.seqstart_k_ptr, g.max_seqlen_q, g.scale_s) == (0x10, 0x20, 77, 0.5)
    assert (g.stride_q, g.nhead_stride_q, g.batch_stride_q) == (512, 128, 0)
    assert g.mask_type == 0

    with pytest.raises(ValueError):
        _capi.make_fwd_args(dtype="fp32", q_ptr=1, k_ptr=1, v_ptr=1, o_ptr=1, batch=1, nhead_q=1, nhead_k=1,
                            hdim_q=8, hdim_v=8, q_strides=(0, 0, 8), k_strides=(0, 0, 8), v_strides=(0, 0, 8),
                            o_strides=(0, 0, 8))
    with pytest.raises(ValueError):  # group mode needs max_seqlen_q
        _capi.make_fwd_args(dtype="fp16", q_ptr=1, k_ptr=1, v_ptr=1, o_ptr=1, batch=1, nhead_q=1, nhead_k=1,
                            hdim_q=8, hdim_v=8, q_strides=(0, 0, 8), k_strides=(0, 0, 8), v_strides=(0, 0, 8),
                            o_strides=(0, 0, 8), seqstart_q_ptr=1, seqstart_k_ptr=2)


def test_make_bwd_args_fills_every_field():
    # q, k, v, dq, dk, dv in b·s·h·d; o, do in b·h·s·d (different layouts on purpose); LSE [b, h, s]
    b, hq, hk, sq, sk, d, dv = 2, 8, 2, 128, 256, 64, 128
    bshd = lambda h, s, dim: (s * h * dim, dim, h * dim)  # noqa: E731  (batch, head, row) strides
    bhsd = lambda h, s, dim: (h * s * dim, s * dim, dim)  # noqa: E731
    a = _capi.make_bwd_args(
        dtype="bf16", q_ptr=0x1000, k_ptr=0x2000, v_ptr=0x3000, o_ptr=0x4000, lse_ptr=0x5000, do_ptr=0x6000,
        dq_ptr=0x7000, dk_ptr=0x8000, dv_ptr=0x9000, workspace_ptr=0xA000, workspace_bytes=1 << 33,
        deterministic=True, batch=b, seqlen_q=sq, seqlen_k=sk, nhead_q=hq, nhead_k=hk, hdim_q=d, hdim_v=dv,
        q_strides=bshd(hq, sq, d), k_strides=bshd(hk, sk, d), v_strides=bshd(hk, sk, dv),
        o_strides=bhsd(hq, sq, dv), lse_strides=(hq * sq, sq),
        mask_type=_capi.MASK_TOP_LEFT, window_left=-1, window_right=0)
    assert a.data_type == _capi.DTYPE_BF16 and a.is_group_mode == 0 and a.deterministic == 1
    assert (a.q_ptr, a.k_ptr, a.v_ptr, a.o_ptr, a.lse_ptr, a.do_ptr) == (
        0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000)
    assert (a.dq_ptr, a.dk_ptr, a.dv_ptr, a.workspace_ptr, a.workspace_bytes) == (
        0x7000, 0x8000, 0x9000, 0xA000, 1 << 33)
    assert a.seqstart_q_ptr is None and a.seqstart_k_ptr is None
    assert (a.seqlen_q, a.seqlen_k, a.batch, a.max_seqlen_q, a.max_seqlen_k) == (sq, sk, b, sq, sk)
    assert (a.hdim_q, a.hdim_v, a.nhead_q, a.nhead_k) == (d, dv, hq, hk)
    assert a.scale == pytest.approx(1 / 8)
    # dq / dk / dv default to the layouts of q / k / v, do to that of o
    assert (a.stride_q, a.stride_k, a.stride_v, a.stride_o, a.stride_do) == (hq * d, hk * d, hk * dv, dv, dv)
    assert (a.stride_dq, a.stride_dk, a.stride_dv) == (hq * d, hk * d, hk * dv)
    assert (a.nhead_stride_q, a.nhead_stride_k, a.nhead_stride_v, a.nhead_stride_o, a.nhead_stride_do) == (
        d, d, dv, sq * dv, sq * dv)
    assert (a.nhead_stride_dq, a.nhead_stride_dk, a.nhead_stride_dv, a.nhead_stride_lse) == (d, d, dv, sq)
    assert (a.batch_stride_q, a.batch_stride_k, a.batch_stride_v, a.batch_stride_o, a.batch_stride_do) == (
        sq * hq * d, sk * hk * d, sk * hk * dv, hq * sq * dv, hq * sq * dv)
    assert (a.batch_stride_dq, a.batch_stride_dk, a.batch_stride_dv, a.batch_stride_lse) == (
        sq * hq * d, sk * hk * d, sk * hk * dv, hq * sq)
    assert (a.mask_type, a.window_size_left, a.window_size_right) == (1, -1, 0)

    # explicit gradient / dO layouts, group mode
    g = _capi.make_bwd_args(
        dtype="torch.float16", q_ptr=1, k_ptr=2, v_ptr=3, o_ptr=4, lse_ptr=5, do_ptr=6, dq_ptr=7, dk_ptr=8,
        dv_ptr=9, batch=3, nhead_q=4, nhead_k=2, hdim_q=64, hdim_v=32,
        q_strides=(0, 64, 256), k_strides=(0, 64, 128), v_strides=(0, 32, 64), o_strides=(0, 32, 128),
        lse_strides=(0, 1000), do_strides=(0, 40, 160), dq_strides=(0, 72, 288), dk_strides=(0, 80, 160),
        dv_strides=(0, 48, 96), seqstart_q_ptr=0x10, seqstart_k_ptr=0x20, max_seqlen_q=77, max_seqlen_k=99,
        scale=0.5)
    assert g.data_type == _capi.DTYPE_FP16 and g.is_group_mode == 1 and g.deterministic == 0
    assert g.workspace_ptr is None and g.workspace_bytes == 0
    assert (g.seqstart_q_ptr, g.seqstart_k_ptr, g.max_seqlen_q, g.max_seqlen_k, g.scale) == (0x10, 0x20, 77, 99, 0.5)
    assert (g.stride_do, g.nhead_stride_do, g.stride_dq, g.nhead_stride_dq) == (160, 40, 288, 72)
    assert (g.stride_dk, g.nhead_stride_dk, g.stride_dv, g.nhead_stride_dv, g.nhead_stride_lse) == (
        160, 80, 96, 48, 1000)
    assert g.mask_type == 0

    common = dict(dtype="fp16", q_ptr=1, k_ptr=1, v_ptr=1, o_ptr=1, lse_ptr=1, do_ptr=1, dq_ptr=1, dk_ptr=1,
                  dv_ptr=1, batch=1, nhead_q=1, nhead_k=1, hdim_q=8, hdim_v=8, q_strides=(0, 0, 8),
                  k_strides=(0, 0, 8), v_strides=(0, 0, 8), o_strides=(0, 0, 8), lse_strides=(0, 0))
    with pytest.raises(ValueError):  # group mode needs max_seqlen_q and max_seqlen_k
        _capi.make_bwd_args(**common, seqstart_q_ptr=1, seqstart_k_ptr=2, max_seqlen_q=4)
    with pytest.raises(ValueError):  # both seqstart pointers
        _capi.make_bwd_args(**common, seqstart_q_ptr=1, max_seqlen_q=4, max_seqlen_k=4)
    with pytest.raises(ValueError):
        _capi.make_bwd_args(**{**common, "lse_strides": (0, 0, 1)})
    with pytest.raises(ValueError):
        _capi.make_bwd_args(**{**common, "dtype": "fp8"})


def test_stream_config():
    c = _capi.make_stream_config(0x1234, time_kernel=True, log_level=1, warmup=3, repeat=7, gpu_timer=False)
    assert (c.stream, c.time_kernel, c.log_level, c.warmup, c.repeat, c.gpu_timer) == (0x1234, 1, 1, 3, 7, 0)
    d = _capi.make_stream_config()
    assert d.stream is None and d.time_kernel == 0 and d.gpu_timer == 1


def test_load_library_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        _capi.load_library(tmp_path / "libmha_fwd.so")


def test_load_library_sets_signatures(tmp_path):
    """Build a stand-in library with the three entry points (host code only) and call it through the loader."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no system C compiler (cc)")
    src = tmp_path / "fake.c"
    src.write_text(r'''
#include <string.h>
#include "mha_fwd.h"
static const char* g_err = "";
const char* mhakit_last_error(void) { return g_err; }
float mhakit_mha_fwd(const mhakit_fwd_args* a, const mhakit_stream_config* c) {
    if (a->hdim_q != 64) { g_err = "hdim 64 only"; return MHAKIT_ERROR_UNSUPPORTED; }
    g_err = "";
    return c->time_kernel ? (float)a->stride_o + a->scale_s : 0.0f;
}
const char* mhakit_mha_fwd_kernel_name(const mhakit_fwd_args* a) {
    if (a->hdim_q != 64) { g_err = "hdim 64 only"; return NULL; }
    return a->window_size_right == 0 ? "fake_causal" : "fake";
}
float mhakit_mha_fwd_splitkv(const mhakit_fwd_splitkv_args* a, const mhakit_stream_config* c) {
    if (a->page_block_size < 0) { g_err = "bad page size"; return MHAKIT_ERROR_INVALID_ARGS; }
    g_err = "";
    return c->time_kernel ? (float)a->batch_stride_block_table + a->num_splits : 0.0f;
}
const char* mhakit_mha_fwd_splitkv_kernel_name(const mhakit_fwd_splitkv_args* a) {
    return a->block_table_ptr ? "fake_paged" : "fake_contiguous";
}
float mhakit_mha_fwd_splitkv_acc_size(const mhakit_fwd_splitkv_args* a, size_t* lse, size_t* o, int* n) {
    *n = a->num_splits;
    *lse = (size_t)a->num_splits * a->seqlen_q * 4;
    *o = *lse * a->hdim_v;
    return 0.0f;
}
''')
    lib_path = tmp_path / "libmha_fwd.so"
    subprocess.run([cc, "-std=c11", "-shared", "-fPIC", "-I", str(INCLUDE), str(src), "-o", str(lib_path)],
                   check=True)
    lib = _capi.load_library(lib_path)
    assert _capi.load_library(str(lib_path)) is lib

    def args(hdim):
        return _capi.make_fwd_args(dtype="bf16", q_ptr=1, k_ptr=2, v_ptr=3, o_ptr=4, batch=1, seqlen_q=4,
                                   seqlen_k=4, nhead_q=1, nhead_k=1, hdim_q=hdim, hdim_v=hdim,
                                   q_strides=(0, 0, hdim), k_strides=(0, 0, hdim), v_strides=(0, 0, hdim),
                                   o_strides=(0, 0, 1 << 40), scale=0.25, mask_type=1, window_right=0)

    assert lib.mha_fwd(args(64)) == 0.0
    assert lib.mha_fwd(args(64), _capi.make_stream_config(time_kernel=True)) == pytest.approx(float(1 << 40))
    assert lib.kernel_name(args(64)) == "fake_causal"
    assert lib.last_error() == ""
    assert lib.kernel_name(args(128)) is None
    assert lib.last_error() == "hdim 64 only"
    assert lib.mha_fwd_raw(args(128)) == _capi.ERROR_UNSUPPORTED
    with pytest.raises(_capi.MhakitError) as e:
        lib.mha_fwd(args(128))
    assert e.value.code == _capi.ERROR_UNSUPPORTED and "hdim 64 only" in str(e.value)

    kv = _capi.MhakitFwdSplitkvArgs(num_splits=3, seqlen_q=2, hdim_v=5, batch_stride_block_table=1 << 40,
                                    block_table_ptr=8)
    assert lib.mha_fwd_splitkv(kv, _capi.make_stream_config(time_kernel=True)) == pytest.approx(float(1 << 40))
    assert lib.splitkv_kernel_name(kv) == "fake_paged"
    assert lib.splitkv_acc_size(kv) == (24, 120, 3)
    kv.page_block_size = -1
    assert lib.mha_fwd_splitkv_raw(kv) == _capi.ERROR_INVALID_ARGS
    with pytest.raises(_capi.MhakitValueError, match="bad page size"):
        lib.mha_fwd_splitkv(kv)


def test_load_bwd_library_sets_signatures(tmp_path):
    """A stand-in libmha_bwd.so (host code only) called through BwdLibrary."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no system C compiler (cc)")
    with pytest.raises(FileNotFoundError):
        _capi.load_bwd_library(tmp_path / "libmha_bwd.so")
    src = tmp_path / "fake_bwd.c"
    src.write_text(r'''
#include <string.h>
#include "mha_bwd.h"
static const char* g_err = "";
const char* mhakit_last_error(void) { return g_err; }
size_t mhakit_mha_bwd_workspace_size(const mhakit_bwd_args* a) {
    if (a->hdim_q != 64) { g_err = "hdim 64 only"; return 0; }
    g_err = "";
    return a->deterministic ? ((size_t)1 << 40) + (size_t)a->stride_dv : 0;
}
float mhakit_mha_bwd(const mhakit_bwd_args* a, const mhakit_stream_config* c) {
    if (a->hdim_q != 64) { g_err = "hdim 64 only"; return MHAKIT_ERROR_UNSUPPORTED; }
    if (a->workspace_bytes < mhakit_mha_bwd_workspace_size(a)) { g_err = "workspace too small"; return MHAKIT_ERROR_INVALID_ARGS; }
    g_err = "";
    return c->time_kernel ? (float)a->batch_stride_lse + a->scale : 0.0f;
}
const char* mhakit_mha_bwd_kernel_name(const mhakit_bwd_args* a) {
    if (a->hdim_q != 64) { g_err = "hdim 64 only"; return NULL; }
    return a->window_size_right == 0 ? "fake_bwd_causal" : "fake_bwd";
}
''')
    lib_path = tmp_path / "libmha_bwd.so"
    subprocess.run([cc, "-std=c11", "-shared", "-fPIC", "-I", str(INCLUDE), str(src), "-o", str(lib_path)],
                   check=True)
    lib = _capi.load_bwd_library(lib_path)
    assert isinstance(lib, _capi.BwdLibrary)
    assert _capi.load_bwd_library(str(lib_path)) is lib

    def args(hdim, deterministic=False, ws=0):
        return _capi.make_bwd_args(
            dtype="bf16", q_ptr=1, k_ptr=2, v_ptr=3, o_ptr=4, lse_ptr=5, do_ptr=6, dq_ptr=7, dk_ptr=8, dv_ptr=9,
            batch=1, seqlen_q=4, seqlen_k=4, nhead_q=1, nhead_k=1, hdim_q=hdim, hdim_v=hdim,
            q_strides=(0, 0, hdim), k_strides=(0, 0, hdim), v_strides=(0, 0, hdim), o_strides=(0, 0, hdim),
            dv_strides=(0, 0, 96), lse_strides=(1 << 36, 4), deterministic=deterministic,
            workspace_ptr=0x100 if ws else None, workspace_bytes=ws, scale=0.25, mask_type=1, window_right=0)

    assert lib.workspace_size(args(64)) == 0 and lib.last_error() == ""
    need = lib.workspace_size(args(64, deterministic=True))
    assert need == (1 << 40) + 96  # size_t round trip above 4 GiB
    with pytest.raises(_capi.MhakitError) as e:
        lib.workspace_size(args(128))
    assert e.value.code == 0 and "hdim 64 only" in str(e.value)
    assert lib.mha_bwd(args(64)) == 0.0
    assert lib.mha_bwd(args(64), _capi.make_stream_config(time_kernel=True)) == pytest.approx(float(1 << 36))
    assert lib.mha_bwd_raw(args(64, True, need - 1)) == _capi.ERROR_INVALID_ARGS
    assert lib.last_error() == "workspace too small"
    assert lib.mha_bwd(args(64, True, need)) == 0.0
    assert lib.kernel_name(args(64)) == "fake_bwd_causal"
    assert lib.kernel_name(args(128)) is None and lib.last_error() == "hdim 64 only"
    with pytest.raises(_capi.MhakitError) as e:
        lib.mha_bwd(args(128))
    assert e.value.code == _capi.ERROR_UNSUPPORTED and "hdim 64 only" in str(e.value)
