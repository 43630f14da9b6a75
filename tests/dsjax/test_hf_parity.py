"""Live numerical parity with transformers' DeepSeek-V2/V3 (no downloads; tiny random models).

Each config is built, randomised (router and e_score_correction_bias included), saved with
`save_pretrained` and loaded back through `dsjax.hf.load_hf`; `dsjax.hf.parity.check` computes all
measures once per config (module fixture) and the tests below assert on them. Relative error =
max|ours - HF| / max|HF| over the whole tensor (fp32, HF eager attention and experts).
"""
import pytest

torch = pytest.importorskip("torch", reason="HF parity needs torch (test extra)")
transformers = pytest.importorskip("transformers", minversion="5.16.1")

from dsjax.hf import parity as P  # noqa: E402

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
    if res["config"] != "v3":
        pytest.skip("MTP is a DeepSeek-V3 feature")
    if "mtp_logits_rel" not in res:
        pytest.skip("this transformers has no MtpModel")
    assert res["mtp_logits_rel"] <= 1e-5, res
