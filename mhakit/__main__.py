"""``python -m mhakit``: fill, inspect and clear the kernel cache.

    python -m mhakit prebuild --profile default [--api fwd|bwd|all] [--arch sm_90a] [-j 16] [--filter d128]
                              [--build-dir build]   # reuse compile.py's objects
    python -m mhakit prebuild --profile minimal --list   # the instance names a profile (and --filter) selects
    python -m mhakit cache [--verbose]        # where the cache is and what it holds
    python -m mhakit clear                    # remove the cache's entries
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mhakit", description="mhakit's kernel cache (JIT builds)")
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("prebuild", help="build every library a profile's calls need into the cache, ahead of time")
    pre.add_argument("--profile", default="default", help="build profile from codegen/profiles.toml (default: default)")
    pre.add_argument("--arch", default=None, help="target arch, e.g. sm_90a (default: the GPU present, else sm_90a)")
    pre.add_argument("--api", default="fwd", choices=("fwd", "bwd", "all"),
                     help="whose kernels: fwd (mha_fwd, mha_varlen_fwd, mha_fwd_kvcache), bwd (mha_bwd, "
                          "mha_varlen_bwd) or all (default: fwd)")
    pre.add_argument("--filter", default=None, dest="name_filter", help="keep instances whose name matches (glob)")
    pre.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    pre.add_argument("--build-dir", default=None, type=Path,
                     help="keep the objects in this directory and reuse those already there, e.g. compile.py's "
                          "--build-dir (default: a temporary directory)")
    pre.add_argument("--list", action="store_true",
                     help="print the instance names the profile and --filter select, and stop (builds nothing)")
    info = sub.add_parser("cache", help="print the cache directory and its entries")
    info.add_argument("--verbose", action="store_true", help="list every entry's instances")
    sub.add_parser("clear", help="remove every cached library (and the index) of this cache format")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from . import _codegen, jit

    if args.command == "prebuild":
        profiles = _codegen.submodule("profiles")
        toolchain = _codegen.submodule("toolchain")
        catalogue = _codegen.submodule("catalogue")
        if args.jobs is not None and args.jobs < 1:
            print("python -m mhakit prebuild: error: -j must be >= 1", file=sys.stderr)
            return 2
        apis = ("fwd", "bwd") if args.api == "all" else (args.api,)
        try:
            if args.list:
                return _list_instances(args, apis)
            paths = [p for api in apis
                     for p in jit.prebuild(args.profile, args.arch, api=api, name_filter=args.name_filter,
                                           jobs=args.jobs, build_dir=args.build_dir)]
        except (profiles.SelectionError, toolchain.ToolchainError, catalogue.CatalogueError, jit.NoCompilerError) as exc:
            print(f"python -m mhakit prebuild: error: {exc}", file=sys.stderr)
            return 2
        except jit.JitError as exc:
            print(f"python -m mhakit prebuild: error: {exc}", file=sys.stderr)
            return 1
        print(f"{len(paths)} libraries in {jit.default_cache().root}")
        return 0
    cache = jit.default_cache()
    if args.command == "cache":
        entries = cache.entries()
        print(f"cache: {cache.root} (set {jit.ENV_CACHE_DIR} to move it)")
        for e in entries:
            status = "ok" if e["ok"] else "BROKEN (rebuilt on next use)"
            print(f"  {e['name']}: {len(e['instances'])} instances, {status}")
            if args.verbose:
                for name in e["instances"]:
                    print(f"      {name}")
        print(f"{len(entries)} entries")
        from . import _ext
        ext = _ext.cached(cache)
        print(f"C call path for this Python ({_ext.abi_tag()}): "
              + (str(ext) if ext else "not built (the first call or prebuild builds it)"))
        stale = cache.stale_tmp()
        if stale:
            size = sum(nbytes for _, nbytes in stale)
            print(f"{len(stale)} temporary build directories of processes that died ({size / 1e6:.1f} MB) in "
                  f"{cache.tmp_dir}: the next build removes them")
        return 0
    if args.command == "clear":
        if not cache.root.exists():
            print(f"nothing to remove: {cache.root} does not exist")
            return 0
        failures = cache.clear()
        if failures:
            print(f"python -m mhakit clear: error: could not remove {len(failures)} "
                  f"path{'s' if len(failures) != 1 else ''} under {cache.root} (first: {failures[0]})",
                  file=sys.stderr)
            return 1
        print(f"removed {cache.root}")
        return 0
    return 2  # pragma: no cover


def _list_instances(args, apis) -> int:
    """prebuild --list: the instance names the profile and filter select, per API (what --filter matches)."""
    from . import _codegen, jit
    arch = args.arch or jit.default_arch()
    _codegen.submodule("toolchain").require_available_backend(arch)
    for api in apis:
        selection = _codegen.submodule("profiles").select(api, arch, args.profile, args.name_filter)
        for spec in selection.specs:
            print(spec.name)
        print(f"{len(selection.specs)} {api} instances for {arch} (profile {args.profile}"
              f"{', filter ' + args.name_filter if args.name_filter else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
