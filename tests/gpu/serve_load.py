"""Drive a live ninfer-serve on the GPU with N concurrent streaming chat clients (raw HTTP + SSE via
aiohttp, present on the GPU machine) and report TTFT and aggregate decode tok/s as JSON.

    python tests/gpu/serve_load.py ARTIFACT [--clients 8] [--max-tokens 256]
"""
import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import aiohttp

PORT = 18931


async def one(session, url, model, i, max_tokens):
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.8, "seed": 1000 + i,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Tell me a long story about ship number {i}."}]}
    t0 = time.perf_counter()
    first = None
    usage = None
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                d = ch.get("delta", {})
                if first is None and (d.get("content") or d.get("reasoning_content")):
                    first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "end": end, "start": t0, "completion_tokens": usage["completion_tokens"]}


async def drive(url, clients, max_tokens):
    async with aiohttp.ClientSession() as s:
        model = (await (await s.get(f"{url}/v1/models")).json())["data"][0]["id"]
        await one(s, url, model, 999, 8)  # warm-up
        res = await asyncio.gather(*[one(s, url, model, i, max_tokens) for i in range(clients)])
    t0 = min(r["start"] for r in res)
    t1 = max(r["end"] for r in res)
    toks = sum(r["completion_tokens"] for r in res)
    decode = sum(r["completion_tokens"] - 1 for r in res) / max(t1 - t0 - statistics.median(r["ttft_s"] for r in res), 1e-9)
    return {"clients": clients, "completion_tokens": toks, "wall_s": t1 - t0,
            "aggregate_tok_s": toks / (t1 - t0), "aggregate_decode_tok_s": decode,
            "ttft_median_s": statistics.median(r["ttft_s"] for r in res),
            "ttft_max_s": max(r["ttft_s"] for r in res), "per_client_tokens": [r["completion_tokens"] for r in res]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--backend", default="cuda")
    a = ap.parse_args()
    url = f"http://127.0.0.1:{PORT}"
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli.serve", a.artifact, "--backend", a.backend, "--port",
                             str(PORT), "--max-concurrency", str(a.clients), "--max-context", "4096"])
    try:
        import urllib.request
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except Exception:  # noqa: BLE001 - not up yet
                if proc.poll() is not None:
                    sys.exit(f"server exited with {proc.returncode}")
                time.sleep(0.5)
        print(json.dumps(asyncio.run(drive(url, a.clients, a.max_tokens)), indent=1))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
