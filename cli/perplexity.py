"""`ninfer-perplexity ARTIFACT --text FILE` (needs the model forward of issue 4)."""
from ._pending import not_implemented


def main() -> None:
    not_implemented("ninfer-perplexity", "it needs the model forward of issue 4")


if __name__ == "__main__":
    main()
