"""llama.cpp-style slot save / restore (ninfer-serve --slot-save-path): a finished conversation's retained lane
written to a file, given back, and read into a lane of another server process's engine, whose next turn then takes
it from the prefix cache and answers as the first server did; bad requests get typed errors and leave no file."""
import pytest

from tests.server.conftest import LiveServer

MODEL = "ninfer-demo"
TURN1 = [{"role": "system", "content": "Slot files test."}, {"role": "user", "content": "Name a river."}]
TURN2 = TURN1 + [{"role": "assistant", "content": "The Nile."}, {"role": "user", "content": "And a mountain?"}]


def start(artifact, folder):
    return LiveServer(artifact, max_concurrency=2, max_context=512, prefill_chunk=64, max_pending=8,
                      pending_timeout_ms=60_000, slot_save_path=folder)


def ask(server, messages):
    return server.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)


def retained_slot(server) -> int:
    lanes, _ = server.slots()
    kept = [s["id"] for s in lanes if s["state"] == "retained"]
    assert len(kept) == 1, lanes
    return kept[0]


def test_a_saved_slot_restored_in_another_server_serves_the_next_turn(demo_artifact, tmp_path):
    first = start(demo_artifact, tmp_path)
    try:
        r1 = ask(first, TURN1)
        first.wait_idle()
        slot = retained_slot(first)
        status, saved = first.post_json(f"/slots/{slot}?action=save", {"filename": "river.bin"})
        assert status == 200 and saved["id_slot"] == slot and saved["filename"] == "river.bin"
        assert saved["n_saved"] >= r1.usage.prompt_tokens and saved["n_written"] == (tmp_path / "river.bin").stat().st_size
        assert sorted(p.name for p in tmp_path.iterdir()) == ["river.bin"]   # no temporary file left
        want = ask(first, TURN2)                                            # the first server's own next turn
        assert want.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    finally:
        first.stop()
    second = start(demo_artifact, tmp_path)
    try:
        status, restored = second.post_json("/slots/1?action=restore", {"filename": "river.bin"})
        assert status == 200 and restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
        assert retained_slot(second) == 1
        again = ask(second, TURN1)   # the same prompt: the image kept its last token's logits, so nothing runs
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens == r1.usage.prompt_tokens
        assert again.choices[0].message.content == r1.choices[0].message.content
        second.wait_idle()
        got = ask(second, TURN2)
        assert got.usage.prompt_tokens_details.cached_tokens == want.usage.prompt_tokens_details.cached_tokens
        assert got.choices[0].message.content == want.choices[0].message.content
        second.wait_idle()
        status, erased = second.post_json(f"/slots/{retained_slot(second)}?action=erase")
        assert status == 200 and erased["n_erased"] > 0
        assert all(s["state"] == "idle" for s in second.slots()[0])
        assert ask(second, TURN2).usage.prompt_tokens_details.cached_tokens == 0   # nothing left to reuse
    finally:
        second.stop()


@pytest.mark.parametrize("path,body,status,code", [
    ("/slots/0?action=save", {"filename": "../escape.bin"}, 400, "invalid_filename"),
    ("/slots/0?action=save", {"filename": ".hidden"}, 400, "invalid_filename"),
    ("/slots/0?action=save", {}, 400, "invalid_filename"),
    ("/slots/0?action=save", {"filename": "idle.bin"}, 400, "invalid_slot"),        # the lane holds nothing
    ("/slots/0?action=restore", {"filename": "missing.bin"}, 404, "not_found"),
    ("/slots/0?action=restore", {"filename": "junk.bin"}, 400, "invalid_image"),    # not a saved slot
    ("/slots/0?action=fly", {"filename": "x.bin"}, 400, None),
    ("/slots/7?action=erase", None, 404, "invalid_slot"),
])
def test_bad_slot_requests_are_typed_errors_that_write_nothing(demo_artifact, tmp_path, path, body, status, code):
    (tmp_path / "junk.bin").write_bytes(b"not a safetensors file")
    server = start(demo_artifact, tmp_path)
    try:
        got, answer = server.post_json(path, body)
        assert got == status and answer["error"]["code"] == code and answer["error"]["message"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.bin"]
    finally:
        server.stop()


def test_slot_actions_without_a_save_path_are_not_supported(server):
    status, answer = server.post_json("/slots/0?action=erase")
    assert status == 501 and answer["error"]["code"] == "not_supported"
