"""Live numerical parity with transformers' DeepSeek-V2/V3 (no downloads; tiny random models).

Each config is built, randomised (router and e_score_correction_bias included), saved with
`save_pretrained` and loaded back through `dsjax.hf.load_hf`; `hf_parity.check` (beside this file)
computes all measures once per config (module fixture) and the tests below assert on them.
Relative error = max|ours - HF| / max|HF| over the whole tensor (fp32, HF eager attention and
experts).
"""
import sys
from pathlib import Path

import pytest
import torch  # the test extra: a missing torch/transformers fails loudly, never skips
import transformers
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).parent))
import hf_parity as P  # noqa: E402

assert Version(transformers.__version__) >= Version("5.16.1"), "parity needs transformers >= 5.16.1"

CONFIGS = ["v2_lite", "v2", "v3"]


@pytest.fixture(scope="module", params=CONFIGS)
def res(request, tmp_path_factory):
    torch.manual_seed(0)
    return P.check(request.param, tmp_path_factory.mktemp("hf"), verbose=True)


def test_logits_fp32(res):
    assert res["logits_rel"] <= 1e-5, res


def test_hidden_states_per_layer(res):
    # embedding, every layer's output, final norm: locates a failure
    assert len(res["hidden_rel"]) == 4
    assert max(res["hidden_rel"]) <= 1e-5, res["hidden_rel"]


def test_gradients_vs_torch_autograd(res):
    assert res["grad_tensors"] > 50
    assert res["grad_rel_max"] <= 1e-4, (res["grad_rel_worst"], res["grad_rel_max"])


def test_greedy_decode_matches_hf_generate(res):
    assert res["decode_equal"], f"first differing position {res['decode_first_diff']}"


def test_bf16_kl_and_top1(res):
    assert res["bf16_tokens"] >= 500
    assert res["bf16_kl_mean"] <= 1e-3, res
    assert res["bf16_top1"] >= 0.99, res


def test_mtp_logits_vs_transformers(res):
    # MTP is a DeepSeek-V3 feature: the V2 configs have none to compare
    if res["config"] == "v3":
        if "mtp_unavailable" in res:  # only older transformers lack the MtpModel API we compare with
            assert Version(transformers.__version__) < Version("5.24"), res["mtp_unavailable"]
        else:
            assert res["mtp_logits_rel"] <= 1e-5, res
    else:
        assert "mtp_logits_rel" not in res
