"""The console scripts are installed; the GPU-only ones refuse plainly on a machine without a GPU."""
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


def test_tune_without_gpu_writes_nothing(tmp_path):
    from ninfer.runtime.cuda import gpu_available
    if gpu_available():
        pytest.skip("has a GPU: tuning would run")
    r = subprocess.run([str(BIN / "ninfer-tune"), "--specs", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "nothing was written" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_bench_without_gpu_exits_nonzero():
    from ninfer.runtime.cuda import gpu_available
    if gpu_available():
        pytest.skip("has a GPU: the benchmark would run")
    r = subprocess.run([str(BIN / "ninfer-bench"), "ops"], capture_output=True, text=True)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr


def test_bench_model_refuses_an_unknown_omitted_op():
    """Checked before anything runs, with or without a GPU: the bad name and the ops that exist."""
    r = subprocess.run([str(BIN / "ninfer-bench"), "model", "--omit-op", "add_rms_norm_zc", "--omit-op", "no_such_op"],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "--omit-op" in r.stderr and "unknown op no_such_op" in r.stderr and "add_rms_norm_zc" in r.stderr


def test_bench_model_refuses_fewer_steps_than_concurrency_levels():
    """Each level's decode figure is the median of its share of --steps: a level with none is refused up front."""
    r = subprocess.run([str(BIN / "ninfer-bench"), "model", "--concurrency", "1,2,4,8", "--steps", "3"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--steps" in r.stderr and "3 steps for 4 concurrency levels" in r.stderr, r.stderr


def test_bench_model_refuses_to_omit_an_op_with_index_outputs():
    r = subprocess.run([str(BIN / "ninfer-bench"), "model", "--omit-op", "moe_topk"], capture_output=True, text=True)
    assert r.returncode == 2 and "moe_topk" in r.stderr and "integer outputs" in r.stderr, r.stderr


def test_bench_model_refuses_profile_with_omitted_ops():
    """--profile times the whole step (its launches, without CUPTI attached during the timed steps): with --omit-op
    it would see the dropped launches, so the pair is refused up front."""
    r = subprocess.run([str(BIN / "ninfer-bench"), "model", "--profile", "1024", "--omit-op", "add_rms_norm_zc"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--profile" in r.stderr and "--omit-op separately" in r.stderr, r.stderr
