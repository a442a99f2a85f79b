"""`ninfer-bench serve` end to end on the CPU: a real ninfer-serve child process on loopback, real HTTP
streams, the transformers peer built from the artifact's config; and its pieces on their own."""
import json
import subprocess
import sys

import pytest

from ninfer.cli.bench_serve import decode_rate, prompt_text, run_peer, table


def run_bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "ninfer.cli.bench", "serve", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_serve_bench_against_transformers(demo_artifact, tmp_path):
    out = tmp_path / "serve.json"
    r = run_bench("--artifact", str(demo_artifact), "--prompts", "40,120", "--concurrency", "1,3",
                  "--decode-prompt", "30", "--max-tokens", "10", "--next-turn", "12", "--shared-system", "300",
                  "--cache-ram", "64", "--backend", "reference", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ninfer-serve: stopping" in r.stderr          # the server child was stopped before the peer ran
    d = json.loads(out.read_text())
    ours, peer = d["ninfer"], d["peer"]
    assert [abs(p["prompt_tokens"] - n) <= 6 for p, n in zip(ours["prefill"], (40, 120))] == [True, True]
    for p in ours["prefill"]:
        assert p["ttft_s"] > 0 and p["tok_s"] == pytest.approx(p["prompt_tokens"] / p["ttft_s"])
    # the same request again took the whole prompt from the prefix cache (its last token's logits with it)
    for p, t in zip(ours["prefill"], ours["retry"], strict=True):
        assert t["prompt_tokens"] == t["cached_tokens"] == p["prompt_tokens"] and t["ttft_s"] > 0
    assert f"retry {ours['retry'][0]['prompt_tokens']} TTFT" in r.stdout
    # each prefill request's next turn took that prompt from the prefix cache and prefilled only the rest
    for p, t in zip(ours["prefill"], ours["next_turn"], strict=True):
        assert t["after_tokens"] == t["cached_tokens"] == p["prompt_tokens"] and t["ttft_s"] > 0
        assert 12 < t["prompt_tokens"] - p["prompt_tokens"] < 60
    assert f"next turn {ours['next_turn'][1]['prompt_tokens']} TTFT" in r.stdout
    # the second new conversation started from the first's snapshot of their shared system turn (~300 tokens)
    first, second = ours["shared_system"]
    assert first["cached_tokens"] == 0 and 290 < second["cached_tokens"] < first["prompt_tokens"] - 60
    assert "new conv 2" in r.stdout
    # after the decode streams took every lane, the first conversation's next turn came back from host memory whole
    back, = ours["return"]
    assert back["prompt_tokens"] == back["cached_tokens"] == ours["next_turn"][0]["prompt_tokens"]
    assert "return " in r.stdout and d["cache_ram_mib"] == 64
    assert [x["concurrency"] for x in ours["decode"]] == [1, 3]
    for x in ours["decode"]:
        assert x["completion_tokens"] == [10] * x["concurrency"] and x["tok_s"] > 0 and x["window_s"] > 0
    # the peer ran the very prompt lengths ninfer served, and the ratios are ninfer / peer
    assert [p["prompt_tokens"] for p in peer["prefill"]] == [p["prompt_tokens"] for p in ours["prefill"]]
    assert all(p["tok_s"] > 0 for p in peer["prefill"] + peer["decode"])
    for kind in ("prefill", "decode"):
        assert d["ratios"][kind] == pytest.approx([a["tok_s"] / b["tok_s"] for a, b in zip(ours[kind], peer[kind])])
    assert d["ceilings"] is None and "peak_frac" not in ours["prefill"][0]   # no GPU here: no roofline claimed
    assert "decode C=3 tok/s" in r.stdout and "transformers" in r.stdout


def test_serve_bench_passes_the_speculative_config(demo_artifact, tmp_path):
    out = tmp_path / "serve.json"
    r = run_bench("--artifact", str(demo_artifact), "--prompts", "40", "--concurrency", "2", "--decode-prompt", "30",
                  "--max-tokens", "12", "--next-turn", "0", "--shared-system", "0", "--no-retry", "--peer", "none",
                  "--backend", "reference", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                  "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "speculative decoding: ngram, 3 drafts" in r.stderr   # the server's start-up line
    d = json.loads(out.read_text())
    assert d["speculative_config"] == '{"method": "ngram", "num_speculative_tokens": 3}'
    assert [x["completion_tokens"] for x in d["ninfer"]["decode"]] == [[12, 12]]


@pytest.mark.parametrize("args,message", [
    (["--concurrency", "9"], "1..8"),
    (["--prompts", "abc"], "comma-separated integers"),
    (["--artifact", "/nonexistent.ninfer"], "does not exist"),
])
def test_serve_bench_bad_input(args, message):
    r = run_bench(*args, "--peer", "none", timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]


def test_decode_rate_counts_only_the_window_where_all_streams_decode():
    # stream a: a chunk every 0.1 s from t=1.0 (11 tokens); stream b starts at 1.5, a chunk every 0.05 s
    a = {"arrivals": [1.0 + 0.1 * i for i in range(11)], "completion_tokens": 11}
    b = {"arrivals": [1.5 + 0.05 * i for i in range(21)], "completion_tokens": 21}
    rate, window = decode_rate([a, b])
    assert window == pytest.approx(0.5)                  # 1.5 .. 2.0
    assert rate == pytest.approx((5 + 10) / 0.5)         # a: 1.6..2.0 (5 chunks), b: 1.55..2.0 (10 chunks)
    # two tokens per chunk count twice
    b2 = dict(b, completion_tokens=41)
    assert decode_rate([a, b2])[0] == pytest.approx((5 + 20) / 0.5)


def test_prompt_text_is_deterministic_and_about_the_asked_length():
    assert prompt_text(500, 3) == prompt_text(500, 3) != prompt_text(500, 4)
    assert len(prompt_text(500, 3).split()) == 500 - 8


def test_a_peer_that_cannot_build_the_model_reports_it_in_every_row():
    peer = run_peer({"model_type": "no_such_model"}, [16, 32], [1, 2], 8, 4)
    assert len(peer["prefill"]) == 2 and len(peer["decode"]) == 2
    assert all("no_such_model" in r["error"] for r in peer["prefill"] + peer["decode"])
    ours = {"prefill": [{"prompt_tokens": 16, "ttft_s": 0.1, "tok_s": 160.0}, {"prompt_tokens": 32, "ttft_s": 0.1, "tok_s": 320.0}],
            "decode": [{"concurrency": 1, "tok_s": 10.0}, {"concurrency": 2, "tok_s": 18.0}]}
    text = table({"ninfer": ours, "peer": peer, "ratios": {"prefill": [None, None], "decode": [None, None]}})
    assert text.count("error") == 6   # 2 prefill rates + 2 TTFTs + 2 decode rates
