"""dequant_<fmt> on the GPU: the packed matrix decoded to bf16 equals the reference decode bit for bit
(the exact value rounded once), for short last tiles and K not a multiple of 128."""
import numpy as np
import pytest
import torch

from ninfer.runtime.formats import encode
from ninfer.runtime.reference_quant import PACKED

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backends():
    from ninfer.runtime.dispatch import CudaBackend, ReferenceBackend
    return CudaBackend(), ReferenceBackend()


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("n,k", [(1, 8), (77, 200), (130, 72), (300, 5120), (2048, 512), (129, 17408)])
def test_dequant_is_exact(backends, fmt, n, k):
    """The table's route and every route instance by name."""
    cuda, ref = backends
    w = np.random.default_rng(n + k).standard_normal((n, k)).astype(np.float32) * 0.05
    packed = torch.from_numpy(encode(fmt, w)).cuda()
    want = torch.empty((n, k), dtype=torch.bfloat16, device="cuda")
    ref.run(f"dequant_{fmt}", w=packed.clone(), y=want)
    op = f"dequant_{fmt}"
    routes = sorted(kk.instance for kk in cuda.manifest.kernels.values() if kk.op == op and kk.arch == cuda.device.arch)
    assert len(routes) > 1
    for route in [None, *routes]:
        y = torch.full((n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        cuda.run(op, route=route, w=packed, y=y)
        assert torch.equal(y, want), f"{op} [{n}, {k}] via {route or 'the table'}"


def test_long_prefill_over_packed_weights_matches_the_reference():
    """A 300-token prompt in one chunk takes the dequant + dense GEMM path for every packed matrix."""
    import os
    from pathlib import Path
    from ninfer.runtime.engine import Engine
    from ninfer.runtime.models.blocks import DEQUANT_MIN_T
    from ninfer.runtime.tolerance import compare
    oracle = Path(os.environ.get("NINFER_ORACLE_DIR", Path(__file__).resolve().parents[2] / ".carry" / "oracle"))
    path = oracle / "dense.mix.ninfer"
    if not path.is_file():
        pytest.skip(f"no packed artifact at {path}")
    ids = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    assert len(ids) >= DEQUANT_MIN_T
    eng = Engine(path, backend="cuda", max_context=512, max_seqs=1, prefill_chunk=1024)
    ref = Engine(path, backend="reference", max_context=512, prefill_chunk=1024)
    v = compare(eng.score(ids).float().cpu(), ref.score(ids), eng.be.manifest.tolerances["model_bf16"], "300 tokens")
    assert v, v.detail
