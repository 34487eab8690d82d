"""fp4_backend.py: the choice of path for fp4_gemm's products, and the helpers its launches share."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp4_backend
import fp4_gemm


def test_choice_is_restored_and_checked():
    """backend() and fp8_tensor_cores() restore what was chosen before, also when the block raises; bad names
    are refused without changing the choice; fp4_gemm's names are these."""
    before = dict(fp4_backend.choice)
    with pytest.raises(KeyError):
        with fp4_backend.backend("torch", kernel="tiled"):
            assert fp4_backend.choice["backend"] == "torch" and fp4_backend.pinned_kernel() == "tiled"
            with fp4_backend.backend("triton", kernel="gemv"), fp4_backend.fp8_tensor_cores():
                assert fp4_backend.pinned_kernel() == "gemv" and fp4_backend.choice["fp8"]
            assert fp4_backend.pinned_kernel() == "tiled" and not fp4_backend.choice["fp8"]
            raise KeyError
    assert fp4_backend.choice == before
    for name, kernel in (("cutlass", None), ("triton", "marlin")):
        with pytest.raises(ValueError):
            fp4_backend.set_backend(name, kernel)
    assert fp4_backend.choice == before
    assert fp4_gemm.backend is fp4_backend.backend and fp4_gemm._choice is fp4_backend.choice


def test_uses_triton():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # (a device object: no GPU needed)
    with fp4_backend.backend("torch"):
        assert not fp4_backend.uses_triton(cpu) and not fp4_backend.uses_triton(cuda)
    with fp4_backend.backend("auto"):
        assert not fp4_backend.uses_triton(cpu) and fp4_backend.uses_triton(cuda) == fp4_backend.HAS_TRITON
    if fp4_backend.HAS_TRITON:
        with fp4_backend.backend("triton"):
            assert fp4_backend.uses_triton(cpu)


def test_environment_variable_is_read_at_import():
    root = Path(fp4_backend.__file__).parent
    code = "import fp4_backend; print(fp4_backend.choice['backend'])"
    ok = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                        env=dict(os.environ, QERL_FP4_BACKEND="torch"))
    assert ok.returncode == 0 and ok.stdout.strip() == "torch", ok.stderr
    bad = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, QERL_FP4_BACKEND="Torch"))
    assert bad.returncode != 0 and "QERL_FP4_BACKEND='Torch'" in bad.stderr


@pytest.mark.skipif(not fp4_backend.HAS_TRITON, reason="needs triton")
def test_split_k_ranges():
    """K cut into whole blocks of bk: fewer ranges where the last would be empty (272 = 4 x 64 + 16: 8 asked,
    5 left), one where K fits a block."""
    assert fp4_backend.k_chunk(272, 8, 32) == 64 and fp4_backend.split_k(272, 8, 32) == (5, 64)
    assert fp4_backend.split_k(256, 2, 64) == (2, 128)
    assert fp4_backend.split_k(48, 4, 64) == (1, 64)
    assert fp4_backend.split_k(4096, 1, 128) == (1, 4096)


def test_launch_helpers():
    assert fp4_backend.launch_opts(dict(kernel="tiled", BLOCK_M=16, num_warps=4, num_stages=2)) == \
        dict(num_warps=4, num_stages=2)
    assert fp4_backend.launch_opts(dict(kernel="dequant")) == {}

    class InterpretedFunction:
        pass

    compiled, interpreted = object(), InterpretedFunction()
    assert fp4_backend.launchable(interpreted, torch.device("cpu")) is interpreted
    assert fp4_backend.launchable(compiled, torch.device("cuda")) is compiled
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fp4_backend.launchable(compiled, torch.device("cpu"))
