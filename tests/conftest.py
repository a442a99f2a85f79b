import os
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
torch.set_num_threads(1)  # 2-core machines: more intra-op threads make small ops far slower


@pytest.fixture
def spec_tree(tmp_path):
    """A private copy of specs/ and codegen/templates/ to mutate; returns (specs_dir, templates_dir)."""
    specs = tmp_path / "specs"
    templates = tmp_path / "templates"
    shutil.copytree(ROOT / "specs", specs)
    shutil.copytree(ROOT / "codegen" / "templates", templates)
    return specs, templates


@pytest.fixture(scope="session")
def demo_artifact():
    """The embedded demo model (built once, cached under build/demo)."""
    from ninfer.cli.serve import demo_artifact as build
    return build()


def pytest_collection_modifyitems(config, items):
    from ninfer.runtime.cuda import gpu_available
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU (cuInit raised or found no device)")
    for item in items:
        if item.get_closest_marker("gpu"):   # the marker, not the keyword: tests/gpu/ also holds CPU checks
            item.add_marker(skip)
