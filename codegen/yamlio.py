"""Strict YAML reading for specs: duplicate keys are errors, and every error names the file."""
from __future__ import annotations

from pathlib import Path

import yaml


class SpecError(Exception):
    """A spec is invalid. The message names the file, the key path, what is wrong and what is allowed."""

    def __init__(self, file: str | Path, path: str, message: str):
        self.file, self.path = str(file), path
        super().__init__(f"{file}: {path}: {message}" if path else f"{file}: {message}")


class _StrictLoader(yaml.SafeLoader):
    pass


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (line {line}; first at line {seen[key]})", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_yaml(file: Path, root: Path | None = None):
    """Parse one YAML file; malformed YAML and duplicate keys raise SpecError naming file and line."""
    shown = file.relative_to(root) if root and file.is_relative_to(root) else file
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(shown, "", f"cannot read: {e.strerror}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError(shown, "", f"malformed YAML: {where}{problem}") from None
