"""Probe (not a test): where MTP rounds with injected, accepted drafts part from plain decoding on the tiny moe
model (cuda, bf16), the fp32 reference backend's logits at that prefix: its top two tokens and their margin, and
the logits each cuda path gave. A near-tie of the exact model is numerics; a clear fp32 preference for plain's token
with the rounds' token elsewhere is a bug."""
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.gpu.test_speculative_gpu import ORACLE, prompts  # noqa: E402

from ninfer.runtime.engine import Engine  # noqa: E402
from ninfer.runtime.speculative import SpeculativeConfig, drafts_from  # noqa: E402

for kind in sys.argv[1:] or ["moe"]:
    art = ORACLE / f"{kind}.ninfer"
    mk = lambda spec, backend="cuda": Engine(art, backend=backend, max_context=400, max_seqs=4, prefill_chunk=16,  # noqa: E731
                                             speculative=spec)
    plain, spec = mk(None), mk(SpeculativeConfig("mtp", 3))
    ps = prompts(seed=1)
    want = [s.generated for s in plain.generate(ps, max_new=40)]
    with drafts_from({tuple(p): p + w for p, w in zip(ps, want)}):
        got = [s.generated for s in spec.generate(ps, max_new=40)]
    ref = Engine(art, backend="reference", max_context=400, max_seqs=1, prefill_chunk=16)
    for i, (p, g, w) in enumerate(zip(ps, got, want)):
        d = next((j for j, (x, y) in enumerate(zip(g, w)) if x != y), None)
        if d is None:
            print(f"{kind} prompt {i}: identical ({len(g)} tokens)")
            continue
        pre = p + w[:d]
        lr = ref.score(pre)[-1].float()
        lc = plain.score(pre)[-1].float().cpu()
        top = lr.topk(3)
        print(f"{kind} prompt {i}: parts at token {d}: plain {w[d]}, rounds {g[d]}; fp32 top3 {top.indices.tolist()} "
              f"{[round(v, 4) for v in top.values.tolist()]} margin {top.values[0] - top.values[1]:.4f}; "
              f"fp32 logit plain-token {lr[w[d]]:.4f} rounds-token {lr[g[d]]:.4f}; cuda prefill margin "
              f"{lc[w[d]] - lc[g[d]]:.4f}; max |cuda - fp32| over the row {(lc - lr).abs().max():.4f}")
