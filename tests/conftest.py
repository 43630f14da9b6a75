"""Test-wide setup: 8 fake CPU devices (sharding tests), float32 matmuls at full precision,
XLA's CPU backend at optimization level 0, and one XLA compilation cache for the session;
subprocesses (CLI tests) and pytest-xdist's worker processes (pyproject.toml runs two) inherit all
four through the environment.

Optimization level 0 (`--xla_backend_optimization_level=0`, on CPU, unless XLA_FLAGS sets a level): the
suite's time is mostly XLA compiling small programs that then run for milliseconds, and the LLVM
passes of the default level take about a third of it (test_lora.py: 239 s at the default level,
163 s at 0, on 2 cores). The optimized HLO is the same at either level (sharding, fusion and
buffer assignment, which tests inspect; checked on the tiny LoRA model's gradient program: same
text, same temp bytes); only the machine code generated from it differs, which can change the
order of a reduction's additions, so results agree with the default level's to float rounding
(that gradient: in the 6th significant digit of some elements), not bitwise.

The cache: many tests train the same small model (one `loop.train` per case, CLI subprocesses),
and each run traces and lowers its programs again; where the lowered program is identical to one
compiled earlier in the session, XLA's executable comes from JAX's persistent compilation cache
instead of being compiled again (the key covers the program, the devices and the compile
options). Every program is cached, however fast it compiled (minimum compile time 0): the random
init of one tiny model runs about 60 small eager programs, most of which compile in under 0.5 s
(15 to 30 s in all on a busy 2-core machine, under 2 s read back from the cache), and every CLI
subprocess, like every fresh `jax.jit(lambda ...)`, would otherwise compile them again. The
directory is new for every session (made by the pytest process that starts the workers, before
it starts them, so they share it) and removed at exit."""
import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
if os.environ["JAX_PLATFORMS"] == "cpu" and "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"  # not for GPU kernel runs
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="dsjax-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.hookimpl(tryfirst=True)  # before the fixtures of the test (an HF reference built in one)
def pytest_runtest_setup(item):
    """torch (the transformers references of the HF tests) with one intra-op thread: their models
    are tiny, and two OpenMP threads that spin-wait on a 2-core machine shared with anything else
    (XLA's own threads, another process) make every small op wait for a descheduled peer (HF
    parity of one config: 99 s with two threads, 54 s with one, under load; the same either way
    on an idle machine)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
