"""Generation quality on a trained model (`benchmarks/generate_quality.py` over a run trained here):
the int8 latent cache against the bf16 one, and sinks + window on a stream of 20 windows against
the recomputed window (the in-window perplexity of the same predictions) and full attention past
the trained positions. Every perplexity goes through the cache as generation reads it
(`dsjax.model.decode.stream_nll`)."""
import shutil
import sys
from pathlib import Path

import pytest

from dsjax import config as C
from dsjax.data import stdlib_files
from dsjax.data.corpus import stdlib_root
from dsjax.train import loop

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import generate_quality as GQ  # noqa: E402

TRAIN = ["textwrap.py", "bisect.py", "heapq.py", "shlex.py", "string.py", "fnmatch.py", "glob.py", "colorsys.py"]
VALIDATION = ["random.py", "calendar.py", "base64.py", "difflib.py"]


@pytest.fixture(scope="module")
def quality(tmp_path_factory):
    """A 2-layer dense MLA model trained 200 steps on 8 stdlib files (32-token rows), measured on 4
    others: 4 rows of 32 predictions per cache dtype, 4 greedy continuations, and 2 streams of
    20 x 16 tokens through 4 sinks + a window of 16."""
    tmp = tmp_path_factory.mktemp("genq")
    (tmp / "corpus").mkdir()
    std = stdlib_root()
    for f in stdlib_files():
        if f.relative_to(std).as_posix() in TRAIN:
            shutil.copy(f, tmp / "corpus" / f.name)
    val = [str(std / name) for name in VALIDATION]
    cfg = C.load(ROOT / "configs" / "tiny.yaml", [
        f"data.train=[{tmp}/corpus/*.py]", f"data.validation=[{', '.join(val)}]", f"data.cache_dir={tmp}/cache",
        "data.seq_len=32", "data.batch_size=16", "model.vocab_size=300", "model.num_hidden_layers=2",
        "model.first_k_dense_replace=2", "model.hidden_size=64", "model.intermediate_size=192",
        "model.attention_impl=reference", f"train.run_dir={tmp}/run", "train.steps=200", "train.progress=false",
        "train.eval_every=100000", "checkpoint.every=100000", "optim.learning_rate=3e-3", "optim.warmup_steps=20"])
    loop.train(cfg)
    return GQ.run(GQ.parse(["--checkpoint", str(tmp / "run"), "--rows", "4", "--continuations", "4",
                            "--prompt-tokens", "16", "--new-tokens", "16", "--window", "16", "--sink-tokens", "4",
                            "--stream-factor", "20", "--stream-rows", "2"]))


def test_int8_cache_matches_bf16(quality):
    """int8 c_kv with a scale per token: |error| <= max|c_kv| / 254 per element, small against the
    bf16 cache's own rounding of the other elements (2^-9 relative), so perplexity moves by far less
    than 1 % (measured here +0.02 %; the trained configs/tiny.yaml: +0.004 %, top-1 0.998). A
    missing or wrong scale moves it by orders of magnitude."""
    q = quality["cache_dtype"]
    assert q["ppl_float32"] < 60, q  # trained: 300 tokens' uniform perplexity is 300
    assert abs(q["ppl_bfloat16"] / q["ppl_float32"] - 1) < 0.01, q
    assert abs(q["int8_vs_bf16_ppl_change"]) < 0.01, q
    assert q["teacher_forced_top1_agreement"] >= 0.95, q
    assert q["greedy_position_agreement"] >= 0.5, q  # greedy runs may part after a near-tie


def test_sinks_and_window_stay_at_the_in_window_perplexity(quality):
    """20 windows of text through 4 sinks + 16 slots: within 10 % of the recomputed window of 20
    (each prediction from its last 20 tokens at positions 0..19, the full forward), as a cache
    whose ring slots, sink slots or key positions were wrong would not be; the first 20
    predictions equal full attention's. The window alone (20 slots, no sinks) is held to the same
    bound, not asserted worse: a model this small and this briefly trained (like configs/tiny.yaml
    after 700 steps) has no attention sinks, and the window without sinks does as well as with
    them. Full attention over the stream (positions to 320, ten times the 32 trained) is not
    asserted on either: here it is only about 10 % worse than the window (on configs/tiny.yaml
    4.6 times), too close to be a reliable bound."""
    s = quality["streaming"]["summary"]
    sinks, full, alone = s["4 sinks + window 16"], s["full attention"], s["window 20, no sinks"]
    ref = s["window 20 recomputed (reference)"]
    assert quality["streaming"]["tokens_per_stream"] == 321
    for r in (full, alone, ref):
        assert r["first_ppl"] == pytest.approx(sinks["first_ppl"], rel=1e-4)
    assert abs(sinks["stream_over_in_window"] - 1) < 0.10, s
    assert abs(alone["stream_over_in_window"] - 1) < 0.10, s
