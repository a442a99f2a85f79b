"""ninfer-serve --cache-ram: with more conversations than lanes, a lane given back to a new conversation waits in
host memory, and its conversation's next turn takes its prefix from there (the real SDK on a live server)."""
from tests.server.conftest import LiveServer
from tests.server.test_ops import metrics

MODEL = "ninfer-demo"


def ask(client, messages):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)


def test_more_conversations_than_lanes_keep_their_prefixes(demo_artifact):
    for cache_ram_mib, kept in ((64, True), (0, False)):
        server = LiveServer(demo_artifact, max_concurrency=1, max_context=512, prefill_chunk=64, max_pending=8,
                            pending_timeout_ms=60_000, cache_ram_mib=cache_ram_mib)
        try:
            c = server.openai()
            convs = [[{"role": "user", "content": f"Conversation {i}: name a river."}] for i in range(3)]
            firsts = [ask(c, m) for m in convs]       # one lane: each new conversation gives the last one's back
            server.wait_idle()
            m = metrics(server)
            assert m[("ninfer_cache_ram_lanes", ())] == (2 if kept else 0)
            assert (m[("ninfer_cache_ram_bytes", ())] > 0) == kept
            turn = convs[0] + [{"role": "assistant", "content": "The Nile."}, {"role": "user", "content": "A lake?"}]
            r = ask(c, turn)
            assert r.usage.prompt_tokens_details.cached_tokens == (firsts[0].usage.prompt_tokens if kept else 0)
            server.wait_idle()
        finally:
            server.stop()
