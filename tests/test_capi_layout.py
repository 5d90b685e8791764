"""The ctypes mirrors in mhakit._capi must match the C structs of csrc/include/mha_fwd.h byte for byte.

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
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "mha_fwd.h"', "int main(void) {"]
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
    fields = dict(_capi.MhakitFwdArgs._fields_)
    for name, ctype in fields.items():
        if "stride" in name:
            assert ctype is ctypes.c_int64, name
        if name.endswith("_ptr"):
            assert ctype is ctypes.c_void_p, name
    assert fields["scale_s"] is ctypes.c_float


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
