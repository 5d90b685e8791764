#!/usr/bin/env bash
# Prepare what compiling mhakit's ROCm backend needs on a machine without ROCm (Debian/Ubuntu x86-64, no AMD GPU):
#   - upstream clang with HIP support, lld, the LLVM tools and AMD's device libraries (Debian packages);
#   - a small ROCm root: the HIP 7.1 headers and ocml/ockl bitcode from the triton==3.9.0 wheel, the four fp16/bf16
#     HIP headers that wheel lacks from Debian's libamdhip64-dev (trixie), and the one-constant device libraries
#     that Debian's rocm-device-libs (ROCm 5.2) lacks for gfx942, gfx950 and code-object v6;
#   - a pinned composable_kernel source tree (include/ and example/ck_tile/01_fmha/) from the amd-aiter wheel.
# Wheels and .debs are downloaded, unpacked and never installed. Nothing here runs a GPU.
#
#   bash tools/rocm_sdk.sh            # prepare (idempotent; quick when already done), print where things are
#   eval "$(bash tools/rocm_sdk.sh --env)"   # ... and export ROCM_PATH and MHAKIT_CK_DIR for compile.py / tests
#
# MHAKIT_ROCM_SDK_DIR chooses the directory (default ~/.cache/mhakit/rocm-sdk). On a machine with ROCm and a CK
# checkout, none of this is needed: compile.py uses hipcc under ROCM_PATH and CK from MHAKIT_CK_DIR.
set -euo pipefail

LLVM=22
TRITON=triton==3.9.0
AITER=amd-aiter==0.1.7.post2.dev18          # carries composable_kernel (CK 1.1.0 for ROCm 7.1, Nov 2025)
HIPDEV=libamdhip64-dev                        # from Debian trixie: HIP 5.7 fp16/bf16 headers (MIT)
STAMP="llvm$LLVM $TRITON $AITER $HIPDEV/trixie v1"

DIR="${MHAKIT_ROCM_SDK_DIR:-$HOME/.cache/mhakit/rocm-sdk}"
ROOT="$DIR/rocm"
CK="$DIR/composable_kernel"
mode="${1:-}"

log() { echo "[rocm_sdk] $*" >&2; }
trap 'log "failed (line $LINENO): see the messages above"' ERR

have_compiler() {
    command -v "clang++-$LLVM" >/dev/null && command -v "llvm-as-$LLVM" >/dev/null &&
        command -v "clang-offload-bundler-$LLVM" >/dev/null && command -v "ld.lld-$LLVM" >/dev/null &&
        [ -d /usr/lib/x86_64-linux-gnu/amdgcn/bitcode ]
}

install_compiler() {
    have_compiler && return 0
    log "installing clang-$LLVM, lld-$LLVM, llvm-$LLVM, rocm-device-libs (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "clang-$LLVM" "clang-tools-$LLVM" "lld-$LLVM" "llvm-$LLVM" \
        rocm-device-libs unzip >&2
}

# The four HIP headers the triton wheel lacks, from Debian trixie's libamdhip64-dev, fetched with a private apt list
# (the system's sources are left as they are).
fetch_hip_headers() {
    local apt_dir="$DIR/apt-trixie" deb
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs"
    # the machine's own Debian mirror (its configured apt sources), asked for the trixie suite
    local mirror
    mirror=$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null || true; } |
             grep -oE '(https?|file)://[^ ]*/debian/?( |$)' | head -n1 | tr -d ' ' || true)
    [ -n "$mirror" ] || { log "no Debian mirror in the apt sources"; return 1; }
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${mirror%/} trixie main" > "$apt_dir/sources.list"
    local opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o "Dir::Etc::sourceparts=-"
                -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o "APT::Sandbox::User=root")
    apt-get "${opts[@]}" update -qq >&2
    (cd "$apt_dir/debs" && apt-get "${opts[@]}" download -qq "$HIPDEV" >&2)
    deb=$(ls "$apt_dir"/debs/${HIPDEV}_*.deb | head -n1)
    rm -rf "$apt_dir/x" && dpkg-deb -x "$deb" "$apt_dir/x"
    local src="$apt_dir/x/usr/include/hip"
    cp "$src/hip_fp16.h" "$src/hip_bfloat16.h" "$ROOT/include/hip/"
    cp "$src/amd_detail/amd_hip_fp16.h" "$src/amd_detail/amd_hip_bfloat16.h" "$ROOT/include/hip/amd_detail/"
}

# A device library that defines one constant, as ROCm's oclc_* libraries do.
constant_library() {  # name symbol value
    printf 'target triple = "amdgcn-amd-amdhsa"\n@%s = linkonce_odr protected local_unnamed_addr addrspace(4) constant i32 %s, align 4\n' \
        "$2" "$3" | "llvm-as-$LLVM" -o "$ROOT/amdgcn/bitcode/$1.bc"
}

prepare() {
    if [ -f "$DIR/.stamp" ] && [ "$(cat "$DIR/.stamp")" = "$STAMP" ] && have_compiler; then
        return 0
    fi
    install_compiler
    mkdir -p "$DIR/wheels"
    log "downloading $TRITON and $AITER (PyPI, not installed)"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_28_x86_64 -d "$DIR/wheels" "$TRITON" "$AITER" >&2
    local triton aiter tmp
    triton=$(ls "$DIR"/wheels/triton-3.9.0-*.whl | head -n1)
    aiter=$(ls "$DIR"/wheels/amd_aiter-0.1.7.post2.dev18-*.whl | head -n1)
    tmp="$DIR/unpack"; rm -rf "$tmp" "$ROOT" "$CK"; mkdir -p "$tmp"

    log "assembling the ROCm root in $ROOT"
    unzip -q "$triton" 'triton/backends/amd/include/hip/*' 'triton/backends/amd/lib/ocml.bc' \
        'triton/backends/amd/lib/ockl.bc' -d "$tmp"
    mkdir -p "$ROOT/include" "$ROOT/amdgcn/bitcode" "$ROOT/bin"
    cp -r "$tmp/triton/backends/amd/include/hip" "$ROOT/include/"
    cp "$tmp/triton/backends/amd/lib/ocml.bc" "$tmp/triton/backends/amd/lib/ockl.bc" "$ROOT/amdgcn/bitcode/"
    local debian_bc=/usr/lib/x86_64-linux-gnu/amdgcn/bitcode
    cp "$debian_bc"/oclc_*.bc "$debian_bc"/opencl.bc "$ROOT/amdgcn/bitcode/"
    constant_library oclc_isa_version_942 __oclc_ISA_version 9402
    constant_library oclc_isa_version_950 __oclc_ISA_version 9500
    constant_library oclc_abi_version_600 __oclc_ABI_version 600
    printf 'HIP_VERSION_MAJOR=7\nHIP_VERSION_MINOR=1\nHIP_VERSION_PATCH=25424\n' > "$ROOT/bin/.hipVersion"
    fetch_hip_headers

    log "unpacking composable_kernel into $CK"
    unzip -q "$aiter" 'aiter_meta/3rdparty/composable_kernel/include/*' \
        'aiter_meta/3rdparty/composable_kernel/example/ck_tile/01_fmha/*' \
        'aiter_meta/3rdparty/composable_kernel/LICENSE' -d "$tmp"
    mv "$tmp/aiter_meta/3rdparty/composable_kernel" "$CK"
    rm -rf "$tmp"
    echo "$STAMP" > "$DIR/.stamp"
}

prepare
if [ "$mode" = "--env" ]; then
    echo "export ROCM_PATH='$ROOT' MHAKIT_CK_DIR='$CK' MHAKIT_HIP_CLANG='$(command -v clang++-$LLVM)'"
else
    log "ready: ROCM_PATH=$ROOT MHAKIT_CK_DIR=$CK (clang++-$LLVM)"
fi
