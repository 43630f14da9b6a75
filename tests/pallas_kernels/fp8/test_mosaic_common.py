"""The FP8 Mosaic kernels' shared sizing and checks: the shared-memory stage count of the
operand ring and the dtype / schedule refusals that the dense, grouped and 1D1D GEMMs share."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8.mosaic_common import BLOCK, EPI, SMEM_BYTES, TILE_M, stages
from pallas_kernels.fp8.mosaic_gemm import Fp8Config, check_dtypes, check_schedule


@pytest.mark.parametrize("tn,dtype", [(128, jnp.bfloat16), (256, jnp.bfloat16), (128, jnp.float32),
                                      (256, jnp.float32)])
def test_stages_fill_shared_memory(tn, dtype):
    """The most stages that fit beside the output staging, and no more than asked."""
    staging = 4 * EPI * EPI * jnp.dtype(dtype).itemsize
    fit = (SMEM_BYTES - staging) // ((TILE_M + tn) * BLOCK)
    assert stages(tn, dtype, 99) == fit
    assert (fit + 1) * (TILE_M + tn) * BLOCK + staging > SMEM_BYTES
    assert stages(tn, dtype, 3) == 3


def test_stages_refuse_tiles_too_large():
    with pytest.raises(ValueError, match="too large for shared memory"):
        stages(1024, jnp.float32, 4)


def test_shared_checks_name_the_gemm():
    f8 = np.zeros((128, 128), jnp.float8_e4m3fn)
    s = np.ones((128, 1), np.float32)
    check_dtypes("fp8 X", f8, s, f8, s)  # accepted
    with pytest.raises(ValueError, match="^fp8 X needs float8_e4m3fn a_q and b_q"):
        check_dtypes("fp8 X", f8.astype(jnp.bfloat16), s, f8, s)
    with pytest.raises(ValueError, match="^fp8 X needs float32 scales"):
        check_dtypes("fp8 X", f8, s, f8, s.astype(np.float16))
    check_schedule(Fp8Config(tile_n=256, overlap=False))  # accepted
    with pytest.raises(ValueError, match="overlap needs tile_n=128"):
        check_schedule(Fp8Config(tile_n=256))
    with pytest.raises(ValueError, match="grid_minor='k'"):
        check_schedule(Fp8Config(grid_minor="k"))
