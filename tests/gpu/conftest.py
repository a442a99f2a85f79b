"""Fixtures shared by the GPU test files: the cuda backend (TF32 off, so torch references on the GPU are
true fp32) and the reference backend over the same manifest."""
import pytest
import torch


@pytest.fixture(scope="module")
def be():
    from ninfer.runtime.dispatch import CudaBackend
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return CudaBackend()


@pytest.fixture(scope="module")
def ref(be):
    from ninfer.runtime.dispatch import ReferenceBackend
    return ReferenceBackend(be.manifest)
