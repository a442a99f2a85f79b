"""`ninfer-tune`: per-GPU route tables (lands with the performance issue)."""
from ._pending import not_implemented


def main() -> None:
    not_implemented("ninfer-tune", "route tuning lands with issue 6")


if __name__ == "__main__":
    main()
