"""Where the runtime finds generated/ and the cubin cache (overridable by environment)."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generated_dir() -> Path:
    return Path(os.environ.get("NINFER_GENERATED", ROOT / "generated"))


def manifest_path() -> Path:
    return generated_dir() / "manifest.json"


def cache_dir() -> Path:
    return Path(os.environ.get("NINFER_CACHE", ROOT / "build" / "cubins"))
