"""Build-time code generation: specs/*.yaml + codegen/templates/*.cu.j2 -> generated/ (sources + manifest.json)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "templates"
