"""The console scripts are installed; the ones whose issue has not landed say so and exit non-zero."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("script", ["ninfer", "ninfer-serve", "ninfer-quantize", "ninfer-tune", "ninfer-bench",
                                    "ninfer-perplexity"])
def test_console_script_installed(script):
    assert shutil.which(script, path=str(BIN)), f"{script} is not installed in {BIN}"


@pytest.mark.parametrize("script,issue", [("ninfer-tune", "issue 6")])
def test_pending_commands_refuse_plainly(script, issue):
    r = subprocess.run([str(BIN / script)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "not implemented yet" in r.stderr and issue in r.stderr
    assert r.stdout == ""


def test_bench_without_gpu_exits_nonzero():
    from ninfer.runtime.cuda import gpu_available
    if gpu_available():
        pytest.skip("has a GPU: the benchmark would run")
    r = subprocess.run([str(BIN / "ninfer-bench"), "ops"], capture_output=True, text=True)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr
