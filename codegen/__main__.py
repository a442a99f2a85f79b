"""`python -m ninfer.codegen [--specs DIR] [--out DIR]`: validate the specs and (re)write generated/."""
import sys
import time
from pathlib import Path

import click

from . import ROOT, TEMPLATES
from .render import RenderError, generate
from .yamlio import SpecError


@click.command()
@click.option("--specs", "specs_dir", type=click.Path(path_type=Path), default=ROOT / "specs", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "generated", show_default=True)
@click.option("--templates", type=click.Path(path_type=Path), default=TEMPLATES, show_default=True)
def main(specs_dir: Path, out: Path, templates: Path) -> None:
    t0 = time.perf_counter()
    try:
        manifest = generate(specs_dir, templates, out)
    except (SpecError, RenderError) as e:
        click.echo(f"generate failed: {e}", err=True)
        click.echo(f"nothing was written; {out} is as it was", err=True)
        sys.exit(1)
    n = len(manifest["kernels"])
    archs = sorted({k["arch"] for k in manifest["kernels"].values()})
    click.echo(f"generated {n} translation units for {len(manifest['ops'])} ops on {', '.join(archs)} "
               f"-> {out} ({time.perf_counter() - t0:.2f} s)")


if __name__ == "__main__":
    main()
