"""Write the model oracle the GPU tests compare against (run on the CPU machine, where transformers
5.24 is; the GPU machine has another transformers): tiny checkpoints -> bf16 .ninfer artifacts, prompts,
transformers' greedy continuations and teacher-forced fp32 logits of the checkpoint with its weights
rounded to bf16 as the artifact holds them (fp32 compute: the oracle of the model the GPU serves).

    python tests/gpu/make_oracle.py OUTDIR      (then carry OUTDIR to the GPU run; NINFER_ORACLE_DIR=OUTDIR)
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.fixtures.tiny_checkpoints import build  # noqa: E402
from ninfer.runtime.convert import convert, plan_conversion  # noqa: E402

KINDS = {"dense": "Qwen3_5ForCausalLM", "moe": "Qwen3_5MoeForCausalLM", "next": "Qwen3NextForCausalLM"}
NEW = 32
BF16_ALL = [("*", "bf16"), ("gdn_A_log", "fp32"), ("gdn_dt_bias", "fp32")]
# "mix": the recipe's own choice per role (q4 / q5 / q6); the others quantize every quantizable role
PACKED_ARTIFACTS = {"dense": ("mix", "w8", "fp8"), "moe": ("mix",), "next": ("mix",)}


def main(out: Path) -> None:
    import transformers
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(42)
    for kind, cls in KINDS.items():
        d = build(kind, out / "ckpt")
        # every tensor bf16 but A_log / dt_bias, exactly what the GPU engine computes with (it casts float
        # roles such as norms and the router to bf16 at load): artifact, reference engine and oracle agree
        convert(plan_conversion(d, fmt="bf16", overrides=BF16_ALL), out / f"{kind}.ninfer")
        for fmt in PACKED_ARTIFACTS.get(kind, ()):    # packed weights: the GPU test compares with the reference
            convert(plan_conversion(d, fmt=None if fmt == "mix" else fmt), out / f"{kind}.{fmt}.ninfer")
        hf = getattr(transformers, cls).from_pretrained(d, dtype=torch.float32).eval()
        # the oracle is the model the bf16 artifact holds: the GPU engine keeps only A_log and dt_bias in fp32
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if not name.endswith(("A_log", "dt_bias")):
                    p.copy_(p.bfloat16().float())
        cases = []
        for n in (1, 9, 40, 3, 17, 25, 11, 6):  # 8 prompts: the batch test uses all of them
            ids = torch.randint(0, 1024, (1, n), generator=g)
            with torch.no_grad():
                full = hf.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
                logits = hf(full).logits[0]
            cases.append({"prompt": ids[0].tolist(), "greedy": full[0, n:].tolist(), "logits": logits.half()})
        torch.save(cases, out / f"{kind}.oracle.pt")
        print(kind, "ok")
    draft_artifact(out)
    import shutil
    shutil.rmtree(out / "ckpt")


def draft_artifact(out: Path) -> None:
    """dense.draft.ninfer: the dense checkpoint with a 1000-word tokenizer, in the recipe's formats, with a q4 draft
    head of 256 rows (--draft-vocab-size) ranked by a corpus of high ids (tests/gpu/test_speculative_gpu.py)."""
    from ninfer.runtime.draft_head import add_draft_head
    from tests.fixtures.tiny_checkpoints import with_word_tokenizer
    d = with_word_tokenizer(build("dense", out / "ckpt"), out / "ckpt" / "dense_words")
    corpus = out / "ckpt" / "corpus.txt"
    corpus.write_text(" ".join(f"w{i}" for i in range(999, 500, -3)), encoding="utf-8")
    plan = plan_conversion(d)
    add_draft_head(plan, 256, [corpus])
    convert(plan, out / "dense.draft.ninfer")
    plan.checkpoint.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
