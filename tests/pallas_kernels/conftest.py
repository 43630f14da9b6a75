"""Race detection over every interpreted Mosaic GPU kernel launch of a test.

GPU interpret mode starts a fresh race-detection state at each kernel launch (when it sets up
the launch's simulated memory), so `gpu_callbacks.get_races()` after a forward and backward
shows only the last kernel's result. The `kernel_races` fixture records each launch's result
as the launch ends."""
import pytest


@pytest.fixture
def kernel_races(monkeypatch):
    """A list that gets one bool per interpreted kernel launch that ends during the test: True
    when race detection (`InterpretGPUParams(detect_races=True)`) found a race in it."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    found = []
    clear = gpu_callbacks._clear_shared_memory  # runs once per launch, after its last thread

    def record_then_clear():
        found.append(gpu_callbacks.get_races().races_found)
        clear()

    monkeypatch.setattr(gpu_callbacks, "_clear_shared_memory", record_then_clear)
    return found
