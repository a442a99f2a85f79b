"""ninfer-perplexity against an independent computation from transformers' logits (tiny fp32 dense
checkpoint), and the KL mode: an artifact against itself is exactly 0, q4 against fp32 small and positive."""
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ninfer.cli.perplexity import windows
from ninfer.runtime.convert import convert, plan_conversion
from tests.fixtures.tiny_checkpoints import build

BIN = Path(sys.executable).parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def ppl_cli(*args, rc=0):
    r = subprocess.run([str(BIN / "ninfer-perplexity"), *map(str, args)], capture_output=True, text=True, env=ENV,
                       timeout=120)
    assert r.returncode == rc, f"rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, checkpoint dir, fp32 artifact, q4 artifact, ids file, ids)."""
    import transformers
    root = tmp_path_factory.mktemp("ppl")
    d = build("dense", root / "ckpt")
    arts = {}
    for fmt in ("fp32", "q4"):
        arts[fmt] = root / f"dense_{fmt}.ninfer"
        plan = plan_conversion(d, fmt=fmt)
        convert(plan, arts[fmt])
        plan.checkpoint.close()
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    rng = random.Random(3)
    ids = [rng.randrange(1024) for _ in range(90)]
    f = root / "ids.txt"
    f.write_text(" ".join(map(str, ids)), "utf-8")
    return hf, d, arts["fp32"], arts["q4"], f, ids


def reference_nll(hf, ids, window, stride):
    """Token-weighted NLL from transformers' logits, with its own window walk: windows start at
    0, stride, 2*stride...; a token is a target once, in the first window that sees it with context."""
    total, count, done = 0.0, 0, 1
    for s in range(0, len(ids), stride):
        chunk = ids[s:s + window]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([chunk])).logits[0].double(), -1)
        for t in range(max(done, s + 1), s + len(chunk)):
            total -= lp[t - s - 1, ids[t]].item()
            count += 1
        done = max(done, s + len(chunk))
        if s + window >= len(ids):
            break
    return total / count, count


@pytest.mark.parametrize("window,stride", [(32, 32), (32, 12), (90, 90)])
def test_perplexity_equals_transformers(tiny, window, stride):
    hf, _, art, _, f, ids = tiny
    r = ppl_cli(art, "--ids", f, "--window", window, "--stride", stride, "--backend", "reference", "--json")
    got = json.loads(r.stdout)
    nll, count = reference_nll(hf, ids, window, stride)
    assert got["tokens"] == count
    assert got["mean_nll"] == pytest.approx(nll, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(got["mean_nll"]), rel=1e-12)


def test_text_is_tokenized_with_the_artifact_tokenizer(tiny, tmp_path):
    from click.testing import CliRunner
    from ninfer.cli.perplexity import main
    hf, _, art, _, _, _ = tiny
    f = tmp_path / "t.txt"
    f.write_text("hello wörld hello foo wörld wörld hello bar hello wörld", "utf-8")  # WordLevel fixture vocab
    ids = [3, 4, 3, 5, 4, 4, 3, 5, 3, 4]
    res = CliRunner().invoke(main, [str(art), "--text", str(f), "--window", "6", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    nll, count = reference_nll(hf, ids, 6, 6)
    assert got["tokens"] == count == 8 and got["mean_nll"] == pytest.approx(nll, rel=1e-5)
    human = CliRunner().invoke(main, [str(art), "--text", str(f), "--window", "6"])
    assert human.exit_code == 0 and "perplexity" in human.stdout and "8 tokens in 2 windows" in human.stdout


def test_kl_of_an_artifact_against_itself_is_zero(tiny):
    _, _, art, _, f, _ = tiny
    got = json.loads(ppl_cli("kl", art, art, "--ids", f, "--window", 32, "--backend", "reference", "--json").stdout)
    assert got["mean_kl"] == 0.0 and got["top1_agreement"] == 1.0
    assert got["perplexity_quant"] == got["perplexity_base"]


def test_kl_of_the_fp8_kv_cache_against_the_model_dtype_cache(tiny):
    """`kl M M --kv-cache-dtype fp8`: the same weights, QUANT's K and V stored as E4M3 codes: a small positive KL,
    the base's perplexity unchanged (its cache is the model dtype's)."""
    _, _, art, _, f, _ = tiny
    same = json.loads(ppl_cli("kl", art, art, "--ids", f, "--window", 32, "--backend", "reference", "--json").stdout)
    got = json.loads(ppl_cli("kl", art, art, "--ids", f, "--window", 32, "--backend", "reference", "--json",
                             "--kv-cache-dtype", "fp8").stdout)
    assert got["quant_kv_cache_dtype"] == "fp8" and got["perplexity_base"] == same["perplexity_base"]
    assert 0 < got["mean_kl"] < 1e-3 and got["perplexity_quant"] != got["perplexity_base"]   # measured 1.7e-5
    assert got["top1_agreement"] > 0.9


def test_kl_q4_against_fp32_is_small_and_positive(tiny):
    from click.testing import CliRunner
    from ninfer.cli.perplexity import main
    hf, _, fp32, q4, f, ids = tiny
    res = CliRunner().invoke(main, ["kl", str(q4), str(fp32), "--ids", str(f), "--window", "32", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert 1e-4 < got["mean_kl"] < 0.2
    assert 0 < got["top1_agreement"] <= 1
    nll, count = reference_nll(hf, ids, 32, 32)
    assert got["tokens"] == count and got["perplexity_base"] == pytest.approx(math.exp(nll), rel=1e-5)
    # independent KL(base || quant) at one window from the two engines' logits
    from ninfer.runtime.engine import Engine
    eq, eb = Engine(q4, backend="reference", max_context=32), Engine(fp32, backend="reference", max_context=32)
    try:
        lq = torch.log_softmax(eq.score(ids[:32]).double(), -1)
        lb = torch.log_softmax(eb.score(ids[:32]).double(), -1)
    finally:
        eq.close()
        eb.close()
    first_window = (lb.exp() * (lb - lq)).sum(-1)[:31]
    assert (first_window > 0).all()
    text = CliRunner().invoke(main, ["kl", str(q4), str(fp32), "--ids", str(f), "--window", "32"]).stdout
    assert "mean KL(base || quant)" in text and "top-1 agreement" in text


def test_window_walk_counts_each_token_once():
    for n, w, s in [(10, 4, 4), (10, 4, 1), (100, 17, 5), (3, 8, 8), (50, 10, 10)]:
        counted = [t for _, end, first in windows(n, w, s) for t in range(first, end)]
        assert len(counted) == len(set(counted)) and all(1 <= t < n for t in counted)
        for start, end, first in windows(n, w, s):
            assert end - start <= w and first > start          # every target has context in its window
        if s < w:
            assert sorted(counted) == list(range(1, n))        # overlapping windows miss nothing


@pytest.mark.parametrize("args,rc,message", [
    (["{art}", "--ids", "{ids}", "--window", "8", "--stride", "9"], 2, "larger than --window"),
    (["{art}", "--window", "8"], 2, "exactly one of --text FILE or --ids FILE"),
    (["{root}/none.ninfer", "--ids", "{ids}"], 1, "no such file"),
    (["{art}", "--text", "{root}/none.txt"], 1, "cannot read it"),
    (["{art}", "--ids", "{one}"], 1, "at least 2 are needed"),
    (["{art}", "--ids", "{big}"], 1, "outside the vocabulary"),
    (["kl", "{art}", "{root}/none.ninfer", "--ids", "{ids}"], 1, "no such file"),
])
def test_bad_input(tiny, tmp_path, args, rc, message):
    from click.testing import CliRunner
    from ninfer.cli.perplexity import main
    (tmp_path / "one.txt").write_text("5", "utf-8")
    (tmp_path / "big.txt").write_text("[1, 2, 5000]", "utf-8")
    subs = {"{art}": str(tiny[2]), "{ids}": str(tiny[4]), "{root}": str(tmp_path),
            "{one}": str(tmp_path / "one.txt"), "{big}": str(tmp_path / "big.txt")}
    argv = []
    for a in args:
        for k, v in subs.items():
            a = a.replace(k, v)
        argv.append(a)
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == rc and message in res.stderr, (res.exit_code, res.output)
