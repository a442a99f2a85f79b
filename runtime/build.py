"""`python -m ninfer.runtime.build [--archs sm_90a,...] [--jobs N]`: compile every generated unit to the cubin cache."""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import click

from .manifest import Manifest, ManifestError
from .nvrtc import CompileError

# A plain CUDA C++ unit needs ~0.2 GB in NVRTC; CuTe/CUTLASS units up to ~1.5 GB: size jobs for the latter.
GB_PER_JOB = 1.5


def default_jobs() -> int:
    try:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 2**30
    except (ValueError, OSError):
        avail = 4.0
    return max(1, min(os.cpu_count() or 1, int(avail // GB_PER_JOB)))


def _compile(kernel: dict):
    from .cubins import compile_kernel
    try:
        path, fresh, secs = compile_kernel(kernel)
        return kernel, str(path), fresh, secs, None
    except (CompileError, Exception) as e:  # noqa: BLE001 - reported per unit, the build goes on
        return kernel, None, False, 0.0, str(e)


@click.command()
@click.option("--archs", default="", help="comma-separated archs to build (default: all in the manifest)")
@click.option("--ops", default="", help="comma-separated ops to build (default: all)")
@click.option("--jobs", type=int, default=0, help="parallel compiles (default: by cores and free memory)")
@click.option("--prune", is_flag=True, help="afterwards, delete cached cubins of the built archs that the manifest "
              "no longer names (stale sources)")
def main(archs: str, ops: str, jobs: int, prune: bool) -> None:
    try:
        manifest = Manifest.load()
    except ManifestError as e:
        click.echo(f"build failed: {e}", err=True)
        sys.exit(1)
    wanted = {a.strip() for a in archs.split(",") if a.strip()}
    known = {k.arch for k in manifest.kernels.values()}
    if wanted - known:
        click.echo(f"build failed: unknown arch(s) {', '.join(sorted(wanted - known))} "
                   f"(the manifest has: {', '.join(sorted(known))})", err=True)
        sys.exit(1)
    only = {o.strip() for o in ops.split(",") if o.strip()}
    if only - set(manifest.ops):
        click.echo(f"build failed: unknown op(s) {', '.join(sorted(only - set(manifest.ops)))}", err=True)
        sys.exit(1)
    todo = [k.data for k in manifest.kernels.values()
            if (not wanted or k.arch in wanted) and (not only or k.data["op"] in only)]
    jobs = jobs or default_jobs()
    t0 = time.perf_counter()
    compiled = cached = 0
    failures = []
    tty = sys.stderr.isatty()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_compile, k) for k in todo]
        for i, fut in enumerate(as_completed(futures), 1):
            kernel, path, fresh, secs, err = fut.result()
            if err:
                failures.append(err)
                click.echo(f"\nFAILED {err}", err=True)
            elif fresh:
                compiled += 1
            else:
                cached += 1
            name = f"{kernel['arch']}/{kernel['op']}/{kernel['route']}.{kernel['tile']}/{kernel['dtype']}"
            line = f"[{i}/{len(todo)}] {name} {'(%.2f s)' % secs if fresh else '(cached)' if not err else ''}"
            click.echo(f"\r\033[K{line}" if tty else line, err=True, nl=not tty)
    if tty:
        click.echo("", err=True)
    click.echo(f"build: {compiled} compiled, {cached} cached, {len(failures)} failed "
               f"in {time.perf_counter() - t0:.1f} s ({jobs} jobs)")
    if prune and not failures:
        _prune(manifest, wanted or known)
    sys.exit(1 if failures else 0)


def _prune(manifest: Manifest, archs: set) -> None:
    from .cubins import cache_path
    from .paths import cache_dir
    keep = {cache_path(k.data) for k in manifest.kernels.values()}
    stale = [p for a in sorted(archs) for p in sorted((cache_dir() / a).glob("*.cubin")) if p not in keep]
    for p in stale:
        p.unlink()
    click.echo(f"prune: removed {len(stale)} stale cubins")


if __name__ == "__main__":
    main()
