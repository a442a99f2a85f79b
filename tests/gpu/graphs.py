"""What the GPU tests' CUDA-graph checks share (the capture itself is runtime.decode_graph.capture)."""
import torch


def replay_then_eager(graph, fn, *outs) -> list:
    """Replay the graph and keep copies of outs, then run fn eagerly into the same buffers: the caller
    compares the copies with outs (a replay must equal the eager launches bit for bit)."""
    graph.replay()
    torch.cuda.synchronize()
    replayed = [o.clone() for o in outs]
    fn()
    torch.cuda.synchronize()
    return replayed
