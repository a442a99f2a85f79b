"""`ninfer ARTIFACT --prompt ...`: one-shot generation (lands with the engine issue)."""
from ._pending import not_implemented


def main() -> None:
    not_implemented("ninfer", "the engine and CLI land with issue 4")


if __name__ == "__main__":
    main()
