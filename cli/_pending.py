"""Entry points whose issue has not landed yet: say so plainly and exit non-zero (no fake output)."""
import sys


def not_implemented(command: str, issue: str) -> None:
    print(f"{command}: not implemented yet ({issue}). Nothing was done.", file=sys.stderr)
    sys.exit(2)
