#!/usr/bin/env python3
"""Build mhakit's device libraries (libmha_fwd.so, ...) into the current directory, from any directory.

    python3 3rdparty/mhakit/compile.py --api fwd                 # default profile, arch of the GPU present
    python3 compile.py --api fwd --profile minimal --list        # what would be built, and how many
    python3 compile.py --api fwd --filter d128_bf16 -j 16

Torch-free, cpp_extension-style: Jinja renders one source per kernel instance, ninja runs the compiler in parallel
(nvcc for NVIDIA targets; hipcc or clang on CK-tile kernels for AMD gfx targets), and a second run with nothing
changed recompiles nothing. The library is installed atomically.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from codegen.build import BuildError, BuildRequest, build, default_jobs, plan_selection  # noqa: E402
from codegen.catalogue import CatalogueError  # noqa: E402
from codegen.profiles import APIS, SelectionError, load_profiles  # noqa: E402
from codegen.toolchain import ToolchainError, detect_arch, require_available_backend  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    profiles = load_profiles()
    parser = argparse.ArgumentParser(
        prog="compile.py", description=__doc__.split("\n\n")[0],
        epilog="profiles: " + "; ".join(f"{name}: {body.get('description', '')}" for name, body in profiles.items()))
    parser.add_argument("--api", default="fwd", choices=list(APIS),
                        help="which library: fwd -> libmha_fwd.so, bwd -> libmha_bwd.so; *_v3 keeps only the "
                             "arch-specialised (Hopper) families (default: fwd)")
    parser.add_argument("--arch", default=None,
                        help="target, e.g. sm_90a, sm_80, gfx942, gfx90a, gfx950 (default: the GPU present, else sm_90a)")
    parser.add_argument("--profile", default="default", choices=list(profiles), help="named instance set (default: default)")
    parser.add_argument("--filter", default=None, dest="name_filter",
                        help="keep instances whose name contains a match of this glob (a bare word is a substring); comma-separated for several")
    parser.add_argument("--list", action="store_true", help="print the instances that would be built, and stop")
    parser.add_argument("--build-dir", type=Path, default=Path("build"),
                        help="where objects and generated sources go (default: ./build)")
    parser.add_argument("-j", "--jobs", type=int, default=None, help=f"parallel compile jobs (default: {default_jobs()})")
    parser.add_argument("--benchmark", action="store_true",
                        help="also build the benchmark executable (benchmark_mha_<api>) linked against the library")
    parser.add_argument("--verbose", action="store_true", help="show compiler command lines and rejected specs")
    return parser.parse_args(argv)


def check_directories(build_dir: Path, install_dir: Path) -> None:
    """One line (ToolchainError) unless objects can be written under build_dir and the outputs installed into
    install_dir (the current directory): checked before anything is compiled."""
    for directory, what, fix in (
            (build_dir, f"--build-dir {build_dir}", "choose another --build-dir"),
            (install_dir, f"the current directory {install_dir} (the libraries are installed there)",
             "run compile.py from a directory you can write")):
        if directory.exists() and not directory.is_dir():
            raise ToolchainError(f"{what} is not a directory: {fix}")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ToolchainError(f"{what} cannot be created ({exc.strerror}): {fix}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ToolchainError(f"{what} is not writable: {fix}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        arch = args.arch or detect_arch()
        require_available_backend(arch)  # one clear line for an unknown or not-yet-built backend
        request = BuildRequest(api=args.api, arch=arch, profile=args.profile, name_filter=args.name_filter,
                               build_dir=args.build_dir, install_dir=Path.cwd(), jobs=args.jobs,
                               benchmark=args.benchmark, verbose=args.verbose)
        if args.list:
            selection = plan_selection(request)
            for spec in selection.specs:
                print(spec.name)
            print(f"{len(selection.specs)} {args.api} instances for {arch} (profile {args.profile}"
                  f"{', filter ' + args.name_filter if args.name_filter else ''})")
            if args.verbose:
                for name, reasons in selection.rejected:
                    print(f"rejected {name}: {'; '.join(reasons)}")
            return 0
        if args.jobs is not None and args.jobs < 1:
            raise SelectionError("-j must be >= 1")
        check_directories(args.build_dir, Path.cwd())
        build(request)
        return 0
    except (SelectionError, ToolchainError, CatalogueError) as exc:
        print(f"compile.py: error: {exc}", file=sys.stderr)
        return 2
    except BuildError as exc:
        print(f"compile.py: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. the disk filled up during the build
        print(f"compile.py: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("compile.py: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
