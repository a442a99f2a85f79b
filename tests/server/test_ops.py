"""/metrics (parsed by prometheus_client's own parser), /slots, /v1/models, /health, the request log
with rotation, and the `ninfer-serve` command itself."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from ninfer.server.request_log import RequestLog

BIN = Path(sys.executable).parent


def metrics(server, headers=None):
    status, hdrs, body = server.get("/metrics", headers)
    assert status == 200 and hdrs["Content-Type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_parse_and_count(server):
    server.wait_idle()
    before = metrics(server)
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:prompt_seconds_total",
                 "llamacpp:tokens_predicted_seconds_total", "llamacpp:requests_processing",
                 "llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio", "ninfer_lanes_busy",
                 "ninfer_kv_pages_used", "ninfer_kv_pages_total", "ninfer_decode_steps_total"):
        assert (name, ()) in before, name
    info = [labels for name, labels in before if name == "ninfer_cache_config_info"]
    assert info == [(("kv_cache_dtype", "auto"), ("num_pages", str(int(before[("ninfer_kv_pages_total", ())]))),
                     ("page_size", "16"))]
    msgs = [{"role": "user", "content": "Count to three."}]
    r = server.openai().chat.completions.create(model="ninfer-demo", messages=msgs, max_tokens=5, temperature=0)
    server.wait_idle()
    after = metrics(server)
    key = lambda n: (n, ())  # noqa: E731
    assert after[key("llamacpp:prompt_tokens_total")] - before[key("llamacpp:prompt_tokens_total")] == \
        r.usage.prompt_tokens
    assert after[key("llamacpp:tokens_predicted_total")] - before[key("llamacpp:tokens_predicted_total")] == \
        r.usage.completion_tokens
    done = ("ninfer_requests_total", (("outcome", "ok"), ("protocol", "chat")))
    assert after[done] - before.get(done, 0) == 1
    assert after[key("llamacpp:requests_processing")] == 0 and after[key("ninfer_kv_pages_used")] == 0
    assert after[("ninfer_ttft_seconds_count", ())] > before.get(("ninfer_ttft_seconds_count", ()), 0)


def test_slots_models_health(server):
    lanes, pages = server.slots()
    assert [s["id"] for s in lanes] == list(range(8)) and pages == 0
    assert all(s["n_ctx"] == 1024 and s["state"] in ("idle", "retained") and not s["is_processing"] for s in lanes)
    models = server.openai().models.list()
    assert [m.id for m in models.data] == ["ninfer-demo"] and models.data[0].model_extra["context_window"] == 1024
    assert server.openai().models.retrieve("ninfer-demo").id == "ninfer-demo"
    am = server.anthropic().models.list()
    assert am.data[0].id == "ninfer-demo"
    status, _, body = server.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_request_log_records_each_request(think_server):
    c = think_server.anthropic()
    c.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "zebra quokka"}],
                      extra_body={"temperature": 0})
    think_server.wait_idle()
    lines = [json.loads(x) for x in think_server.log_path.read_text().splitlines()]
    done = [x for x in lines if x["event"] == "request_done" and x["protocol"] == "anthropic"]
    assert done, lines
    d = done[-1]
    for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "queue_s", "prefill_s", "decode_s", "ttft_s",
              "total_s", "finish_reason"):
        assert k in d, k
    assert d["completion_tokens"] == 3 and d["ttft_s"] > 0 and d["schema"] == "ninfer_serve_request_log"
    assert "quokka" not in think_server.log_path.read_text()      # no prompt text in the log


def test_request_log_rotation(tmp_path):
    p = tmp_path / "log.jsonl"
    log = RequestLog(p, max_mib=0.001, keep=2)      # ~1 KiB per file
    for i in range(60):
        log.write("request_done", i=i, pad="x" * 40)
    log.close()
    files = sorted(x.name for x in tmp_path.iterdir())
    assert files == ["log.jsonl", "log.jsonl.1", "log.jsonl.2"]
    for f in tmp_path.iterdir():
        assert f.stat().st_size <= 1100
        for line in f.read_text().splitlines():
            json.loads(line)
    last = [json.loads(x)["i"] for x in p.read_text().splitlines()]
    assert last[-1] == 59


def test_serve_command_starts_answers_and_stops(demo_artifact, tmp_path):
    """`ninfer-serve ARTIFACT` in its own process: port 0, a request log, prefix caching off, SIGTERM ends it
    cleanly."""
    log = tmp_path / "r.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([str(BIN / "ninfer-serve"), str(demo_artifact), "--port", "0", "--max-context", "256",
                          "--max-concurrency", "2", "--backend", "reference", "--request-log-jsonl", str(log),
                          "--model-id", "demo-x", "--no-enable-prefix-caching"], stderr=subprocess.PIPE, text=True,
                         env=env)
    try:
        port, seen = None, []
        deadline = time.monotonic() + 90
        while port is None and time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
        assert port, "".join(seen)
        import openai
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        turn = [{"role": "user", "content": "hi"}]
        r = c.chat.completions.create(model="demo-x", messages=turn, max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
        turn += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
        r = c.chat.completions.create(model="demo-x", messages=turn, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0   # the next turn, but the cache is off
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    events = [json.loads(x)["event"] for x in log.read_text().splitlines()]
    assert events[0] == "server_start" and "request_done" in events


def test_serve_command_refuses_bad_usage(tmp_path):
    r = subprocess.run([str(BIN / "ninfer-serve")], capture_output=True, text=True)
    assert r.returncode == 2 and "ARTIFACT or --demo" in r.stderr
    r = subprocess.run([str(BIN / "ninfer-serve"), str(tmp_path / "none.ninfer")], capture_output=True, text=True)
    assert r.returncode == 1 and "no such file" in r.stderr
    r = subprocess.run([str(BIN / "ninfer-serve"), "x.ninfer", "--max-concurrency", "9"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "max-concurrency" in r.stderr
