"""The `ninfer` command, run as a real subprocess on the reference backend.

Token-level checks use the tiny fp32 dense artifact (transformers is the oracle for greedy tokens);
text-level checks (real tokenizer, chat template, stop strings, sampling defaults) use the embedded
demo artifact built by `python -m ninfer.cli.demo` (random weights, real Qwen3.5 tokenizer)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ninfer.runtime.artifact import ArtifactWriter, TensorSpec, open_artifact
from ninfer.runtime import chat
from ninfer.runtime.chat import load_template, render, split_reasoning
from ninfer.runtime.convert import convert, plan_conversion
from ninfer.runtime.engine import Engine, SamplingParams
from ninfer.runtime.tokenizer import Tokenizer
from tests.fixtures.tiny_checkpoints import build

BIN = Path(sys.executable).parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
TINY_PROMPT = "hello wörld hello foo wörld"          # WordLevel fixture tokenizer: [3, 4, 3, 5, 4]


def ninfer(*args, check_rc=0):
    r = subprocess.run([str(BIN / "ninfer"), *map(str, args)], capture_output=True, text=True, env=ENV, timeout=120)
    if check_rc is not None:
        assert r.returncode == check_rc, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def run_json(*args):
    r = ninfer(*args, "--json")
    return json.loads(r.stdout), r.stderr


def rewrite(src: Path, dst: Path, **resources: bytes) -> Path:
    """Copy an artifact with some resources replaced (tensors byte for byte)."""
    with open_artifact(src) as a:
        specs = [TensorSpec(t.name, t.shape, t.format, t.role, t.flags) for t in a.tensors.values()]
        res = [(n, resources.get(n.replace(".", "_"), a.resource(n))) for n in a.resources]
        with ArtifactWriter(dst, a.model_family, specs, [(n, len(b)) for n, b in res]) as w:
            for t in a.tensors.values():
                w.add_tensor(t.name, [a.raw(t.name)])
            for n, b in res:
                w.add_resource(n, b)
    return dst


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def tiny(root):
    """(HF model, checkpoint dir, fp32 artifact) of the tiny dense hybrid."""
    import transformers
    d = build("dense", root / "ckpt")
    out = root / "dense.ninfer"
    plan = plan_conversion(d, fmt="fp32")
    convert(plan, out)
    plan.checkpoint.close()
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return hf, d, out


@pytest.fixture(scope="module")
def demo(root):
    from ninfer.cli.demo import build_demo
    out = root / "demo.ninfer"
    build_demo(out)
    return out


@pytest.fixture(scope="module")
def qwen(demo):
    with open_artifact(demo) as a:
        return Tokenizer.from_artifact(a)


def test_demo_artifact_is_a_small_genuine_ninfer(demo, qwen):
    from ninfer.cli.demo import DEMO_MARKER
    assert demo.stat().st_size <= 70 << 20
    with open_artifact(demo) as a:
        a.verify()
        cfg, gen = json.loads(a.resource("config.json")), json.loads(a.resource("generation_config.json"))
        assert a.model_family == "qwen3_5" and DEMO_MARKER in cfg
        assert cfg["vocab_size"] == 248320 and cfg["layer_types"].count("full_attention") == 1
        assert gen["eos_token_id"] == [248046, 248044] and gen["temperature"] == 0.6
        assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "recipe.yaml"} <= set(a.resources)
        assert a.tensors["embed"].format == "q6" and "lm_head" not in a.tensors      # tied, recipe formats
        assert load_template(a).source == Path(chat.OUR_TEMPLATE).read_text("utf-8")
    assert qwen.vocab_size == 248077 and qwen.token_id("<|im_end|>") == 248046


# -- tokens --------------------------------------------------------------------------------------
def test_greedy_json_equals_transformers(tiny):
    hf, _, art = tiny
    out, err = run_json(art, "--raw-output", "--prompt", TINY_PROMPT, "--greedy", "--max-new", 24,
                        "--backend", "reference")
    assert out["prompt_token_ids"] == [3, 4, 3, 5, 4]
    with torch.no_grad():   # default stop ids: no eos in generation_config, <|im_end|> (2) from the tokenizer
        ref = hf.generate(torch.tensor([out["prompt_token_ids"]]), max_new_tokens=24, do_sample=False,
                          eos_token_id=2, pad_token_id=0)[0, 5:].tolist()
    assert out["token_ids"] == ref and len(ref) > 0
    assert out["finish_reason"] == ("stop" if ref[-1] == 2 else "length")
    t = out["timings"]
    assert t["prompt_tokens"] == 5 and t["generated_tokens"] == len(ref)
    assert t["prefill_s"] > 0 and t["ttft_s"] > 0 and t["prefill_tok_s"] > 0
    assert out["memory"]["weights_bytes"] > 0 and out["backend"] == "reference"
    assert err == ""     # --json: nothing else on either stream for a non-demo model


def test_fp8_kv_cache_option(tiny):
    """--kv-cache-dtype fp8: the cache holds E4M3 codes (a quarter of the fp32 reference cache's bytes); greedy
    tokens come out; an unknown value is a usage error."""
    _, _, art = tiny
    args = ("--raw-output", "--prompt", TINY_PROMPT, "--greedy", "--max-new", 8, "--backend", "reference")
    auto, _ = run_json(art, *args)
    fp8, _ = run_json(art, *args, "--kv-cache-dtype", "fp8")
    assert len(fp8["token_ids"]) == len(auto["token_ids"]) > 0
    assert fp8["memory"]["cache_bytes"] < auto["memory"]["cache_bytes"]
    r = ninfer(art, "--prompt", "x", "--kv-cache-dtype", "fp16", check_rc=2)
    assert "'fp16' is not one of 'auto', 'fp8', 'fp8_e4m3'" in r.stderr


def test_chat_prompt_uses_the_artifact_template_and_stop_token_ids(tiny):
    hf, d, art = tiny
    with open_artifact(art) as a:
        tok = Tokenizer.from_artifact(a)
        prompt = tok.encode(render([{"role": "user", "content": "hello wörld"}], template=load_template(a)))
    out, _ = run_json(art, "--prompt", "hello wörld", "--max-new", 12, "--stop-token-id", 7)
    assert out["prompt_token_ids"] == prompt       # the fixture's own chat template (CRLF, no gen prompt)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=7,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert out["token_ids"] == ref


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                           "parameters": {"type": "object",
                                                          "properties": {"word": {"type": "string"}}}}}]
MSGS = [{"role": "system", "content": "You are a dictionary."}, {"role": "user", "content": "Define 'noise'."}]
DEMO_STOPS = {248046, 248044}      # the demo's generation_config eos ids (<|im_end|> among them)


@pytest.fixture(scope="module")
def demo_engine(demo):
    eng = Engine(demo, backend="reference", max_context=512, max_seqs=1)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def turn1(demo, root):
    """One chat turn on the demo: messages + tools from a file, default (generation_config) sampling."""
    f = root / "turn1.json"
    f.write_text(json.dumps({"messages": MSGS, "tools": TOOLS}), "utf-8")
    out, err = run_json(demo, "--messages", f, "--max-new", 16, "--seed", 5)
    return f, out, err


def test_chat_turn_prompt_and_sampling_defaults(demo, qwen, turn1, demo_engine):
    """The prompt is our template's rendering (tools in the system turn); sampling defaults come from
    generation_config.json (temperature 0.6, top_k 20, top_p 0.95) and the eos ids stop it."""
    _, out, err = turn1
    with open_artifact(demo) as a:
        template = load_template(a)
    assert out["prompt_token_ids"] == qwen.encode(render(MSGS, tools=TOOLS, template=template))
    assert "OUTPUT IS NOISE" in err
    seq = demo_engine.generate([out["prompt_token_ids"]], max_new=16, stop_ids=DEMO_STOPS,
                               sampling=SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=5))[0]
    assert out["token_ids"] == seq.generated and out["finish_reason"] == seq.finish_reason
    greedy = demo_engine.generate([out["prompt_token_ids"]], max_new=16, stop_ids=DEMO_STOPS)[0]
    assert seq.generated != greedy.generated
    assert out["text"] == qwen.decode([t for t in seq.generated if t not in DEMO_STOPS])


def test_next_turn_prompt_extends_this_one(demo, qwen, turn1, root):
    _, one, _ = turn1
    answer = one["content"] or "ok"
    f = root / "turn2.json"   # the answer goes back with its reasoning, which the template drops
    f.write_text(json.dumps({"messages": MSGS + [
        {"role": "assistant", "content": answer, "reasoning_content": one["reasoning"] or "hidden"},
        {"role": "user", "content": "Thanks."}], "tools": TOOLS}), "utf-8")
    two, _ = run_json(demo, "--messages", f, "--max-new", 1)
    p1, p2 = one["prompt_token_ids"], two["prompt_token_ids"]
    assert p2[:len(p1)] == p1
    assert qwen.decode(p2).startswith(qwen.decode(p1) + answer + "<|im_end|>\n<|im_start|>user\nThanks.")


def test_stop_string_cuts_the_text(demo, qwen, turn1):
    f, free, _ = turn1
    text = free["text"]
    # a stop string that first occurs well inside the text
    k = next(i for i in range(4, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stop = text[k:k + 3]
    cut, _ = run_json(demo, "--messages", f, "--max-new", 16, "--seed", 5, "--stop", stop,
                      "--stop", "never-in-noise-\u2603")
    assert cut["text"] == text[:k] and cut["finish_reason"] == "stop" and cut["stop"] == stop
    n = len(cut["token_ids"])
    assert n < len(free["token_ids"]) and cut["token_ids"] == free["token_ids"][:n]   # generation ended there
    assert stop in qwen.decode(cut["token_ids"]) and stop not in qwen.decode(cut["token_ids"][:-1])


def test_plain_output_no_thinking(demo, qwen, turn1, demo_engine):
    """Without --json: the answer streams to stdout; the warning, timings and memory go to stderr.
    --no-thinking renders the closed empty <think> block."""
    f = turn1[0]
    r = ninfer(demo, "--messages", f, "--no-thinking", "--seed", 9, "--max-new", 8)
    with open_artifact(demo) as a:
        prompt = render(MSGS, tools=TOOLS, enable_thinking=False, template=load_template(a))
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    seq = demo_engine.generate([qwen.encode(prompt)], max_new=8, stop_ids=DEMO_STOPS,
                               sampling=SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=9))[0]
    reasoning, content = split_reasoning(qwen.decode([t for t in seq.generated if t not in DEMO_STOPS]))
    assert content and r.stdout == content + ("" if content.endswith("\n") else "\n")
    assert "OUTPUT IS NOISE" in r.stderr
    for word in ("prefill", "TTFT", "decode", "tok/s", "memory: weights", "peak RSS"):
        assert word in r.stderr


def test_chat_template_file_overrides(tiny, tmp_path):
    _, _, art = tiny
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content }} hello{% endfor %}", "utf-8")
    out, _ = run_json(art, "--prompt", "wörld", "--chat-template", f, "--max-new", 1)
    assert out["prompt_token_ids"] == [4, 3]


# -- bad input -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_files(root, tiny):
    _, _, art = tiny
    with open_artifact(art) as a:
        cfg = json.loads(a.resource("config.json"))
    cfg["model_type"] = "llama"
    files = {"llama": rewrite(art, root / "llama.ninfer", config_json=json.dumps(cfg).encode())}
    for name, text in {"broken.jinja": "{% for m in messages %}", "refuses.jinja": "{{ raise_exception('no way') }}",
                       "bad.json": "[{\"role\": \"user\", ", "shape.json": "{\"msgs\": []}",
                       "role.json": "[{\"role\": \"robot\", \"content\": \"x\"}]", "empty.json": "[]",
                       "garbage.ninfer": "not an artifact at all"}.items():
        files[name] = root / name
        files[name].write_text(text, "utf-8")
    return files


BAD_CASES = [
    ("missing artifact", ["{root}/nope.ninfer", "--prompt", "hi"], "nope.ninfer: no such file"),
    ("not an artifact", ["{garbage.ninfer}", "--prompt", "hi"], "bad magic"),
    ("empty prompt", ["{art}", "--prompt", ""], "empty prompt"),
    ("blank raw prompt", ["{art}", "--raw-output", "--prompt", "   "], "empty prompt"),
    ("too long", ["{art}", "--raw-output", "--prompt", "hello " * 40, "--max-context", "16"],
     "the prompt is 40 tokens; with --max-context 16 at most 15"),
    ("unknown family", ["{llama}", "--prompt", "hi"], "unknown model_type 'llama'"),
    ("template syntax", ["{art}", "--prompt", "hi", "--chat-template", "{broken.jinja}"], "syntax error at line 1"),
    ("template refuses", ["{art}", "--prompt", "hi", "--chat-template", "{refuses.jinja}"],
     "refused the messages: no way"),
    ("template missing", ["{art}", "--prompt", "hi", "--chat-template", "{root}/none.jinja"], "cannot read it"),
    ("messages missing", ["{art}", "--messages", "{root}/none.json"], "cannot read it"),
    ("messages not json", ["{art}", "--messages", "{bad.json}"], "not valid JSON"),
    ("messages shape", ["{art}", "--messages", "{shape.json}"], "expected a JSON array of messages"),
    ("messages role", ["{art}", "--messages", "{role.json}"], "'robot' is not one of"),
    ("messages empty", ["{art}", "--messages", "{empty.json}"], "the list is empty"),
    ("sampling", ["{art}", "--prompt", "hi", "--top-p", "0"], "0 < top_p <= 1"),
]
BAD = {case: (args, message) for case, args, message in BAD_CASES}


def _subs(args, tiny, bad_files, root):
    subs = {"root": str(root), "art": str(tiny[2]), **{k: str(v) for k, v in bad_files.items()}}
    out = []
    for a in args:        # "{key}rest" -> subs[key] + rest
        if a.startswith("{") and "}" in a:
            a = subs[a[1:a.index("}")]] + a[a.index("}") + 1:]
        out.append(a)
    return out


@pytest.mark.parametrize("case,args,message", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_is_refused_clearly(tiny, bad_files, root, case, args, message):
    """In process (fast): the message on stderr, exit status 1, nothing on stdout."""
    from click.testing import CliRunner
    from ninfer.cli.main import main
    res = CliRunner().invoke(main, _subs(args, tiny, bad_files, root))
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (res.output, res.exception)
    assert res.stdout == ""
    assert res.stderr.startswith("Error: ") and message in res.stderr, res.stderr


@pytest.mark.parametrize("case", ["missing artifact", "unknown family", "too long"])
def test_bad_input_subprocess(tiny, bad_files, root, case):
    """The same refusals from the real command: exit status 1, the message, no traceback."""
    args, message = BAD[case]
    r = ninfer(*_subs(args, tiny, bad_files, root), check_rc=1)
    assert r.stdout == "" and r.stderr.startswith("Error: ") and message in r.stderr
    assert "Traceback" not in r.stderr


def test_usage_errors_exit_2(tiny):
    for args in ([], ["--prompt", "a", "--messages", "m.json"], ["--messages", "m.json", "--raw-output"]):
        r = ninfer(tiny[2], *args, check_rc=2)
        assert "Usage:" in r.stderr and r.stdout == ""


def test_cuda_backend_without_gpu_is_refused(tiny):
    from ninfer.runtime.cuda import gpu_available
    if gpu_available():
        pytest.skip("a GPU is present: the cuda backend would start")
    r = ninfer(tiny[2], "--prompt", "hi", "--backend", "cuda", check_rc=1)
    assert "cannot start the cuda backend" in r.stderr and r.stdout == ""


def _holders(path: Path) -> list[str]:
    """This process's open descriptors and memory mappings of `path`."""
    target = str(path.resolve())
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    maps = Path("/proc/self/maps").read_text().splitlines()
    return [f for f in fds if f == target] + [m for m in maps if m.endswith(target)]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_nothing_stays_allocated_in_process(tiny, bad_files, root):
    """In-process runs: after a refusal (and after a normal run) the artifact is neither open nor mapped."""
    import gc
    from click.testing import CliRunner
    from ninfer.cli.main import main
    _, _, art = tiny
    runner = CliRunner()
    for args in (["--prompt", "hi", "--chat-template", str(bad_files["broken.jinja"])],
                 ["--raw-output", "--prompt", "hello " * 40, "--max-context", "16"],
                 ["--raw-output", "--prompt", TINY_PROMPT, "--max-new", "2", "--top-p", "0"]):
        res = runner.invoke(main, [str(art), *args])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        gc.collect()
        assert _holders(art) == []
    res = runner.invoke(main, [str(art), "--raw-output", "--prompt", TINY_PROMPT, "--max-new", "3", "--json"])
    assert res.exit_code == 0, res.output
    gc.collect()
    assert _holders(art) == []
