"""`_hopper.target_device`: the kernels' view of the device (Hopper or not, SMs) follows the
target while it is active, and the default device again after."""
import types

import pytest

from pallas_kernels import _hopper


def _gpu(cc: str, sms: int):
    return types.SimpleNamespace(platform="gpu", compute_capability=cc, core_count=sms)


def test_target_device_describes_the_target_then_the_default_again():
    default = (_hopper.on_hopper(), _hopper.on_gpu(), _hopper.num_sms())
    with _hopper.target_device(_gpu("9.0", 132)):
        assert (_hopper.on_hopper(), _hopper.on_gpu(), _hopper.num_sms()) == (True, True, 132)
        with _hopper.target_device(_gpu("8.0", 108)):  # an A100: a GPU, not Hopper
            assert (_hopper.on_hopper(), _hopper.on_gpu(), _hopper.num_sms()) == (False, True, 2)
        assert _hopper.num_sms() == 132
    assert (_hopper.on_hopper(), _hopper.on_gpu(), _hopper.num_sms()) == default


def test_target_device_is_reset_after_an_error():
    before = _hopper.on_hopper()
    with pytest.raises(RuntimeError, match="inside"):
        with _hopper.target_device(_gpu("9.0", 132)):
            raise RuntimeError("inside")
    assert _hopper.on_hopper() == before
