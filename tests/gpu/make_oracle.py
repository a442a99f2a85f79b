"""Write the model oracle the GPU tests compare against (run on the CPU machine, where transformers
5.24 is; the GPU machine has another transformers): tiny checkpoints -> bf16 .ninfer artifacts, prompts,
transformers' greedy continuations and teacher-forced fp32 logits.

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


def main(out: Path) -> None:
    import transformers
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(42)
    for kind, cls in KINDS.items():
        d = build(kind, out / "ckpt")
        convert(plan_conversion(d, fmt="bf16"), out / f"{kind}.ninfer")  # the GPU runs bf16 anyway
        hf = getattr(transformers, cls).from_pretrained(d, dtype=torch.float32).eval()
        cases = []
        for n in (1, 9, 40, 3, 17, 25, 11, 6):  # 8 prompts: the batch test uses all of them
            ids = torch.randint(0, 1024, (1, n), generator=g)
            with torch.no_grad():
                full = hf.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
                logits = hf(full).logits[0]
            cases.append({"prompt": ids[0].tolist(), "greedy": full[0, n:].tolist(), "logits": logits.half()})
        torch.save(cases, out / f"{kind}.oracle.pt")
        print(kind, "ok")
    import shutil
    shutil.rmtree(out / "ckpt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
