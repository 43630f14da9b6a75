"""`benchmarks/step_bytes.py`'s byte count, on programs compiled here by XLA:CPU (the compiled HLO
text has the GPU compiler's format): gathers count their rows, loop bodies their trip count."""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import step_bytes as S  # noqa: E402


def _ops(f, *args):
    return S.hlo_bytes(jax.jit(f).lower(*args).compile().as_text())


def test_type_bytes():
    assert S.type_bytes("(f32[4,8]{1,0}, bf16[2])") == 4 * 32 + 2 * 2
    assert S.type_bytes("pred[] ") == 1 and S.type_bytes("s32[0]{0}") == 0


def test_an_elementwise_op_reads_and_writes_its_arrays():
    x = jnp.ones((256, 256), jnp.float32)
    ops = _ops(lambda x: jnp.exp(x) * 2, x)
    assert sum(b for _, _, b, _ in ops) == 2 * x.nbytes


def test_a_gather_reads_its_rows_not_the_table():
    table, idx = jnp.ones((1000, 64), jnp.float32), jnp.arange(16, dtype=jnp.int32)
    ops = _ops(lambda t, i: jnp.tanh(t[i]), table, idx)
    rows = 16 * 64 * 4
    assert sum(b for _, _, b, _ in ops) == 2 * rows + idx.nbytes  # rows read, rows written, ids


def test_a_loop_body_counts_once_per_trip():
    x = jnp.ones((256, 256), jnp.float32)
    ops = _ops(lambda x: jax.lax.fori_loop(0, 5, lambda i, y: jnp.sin(y) + 1.0, x), x)
    body = [(b, n) for _, _, b, n in ops if n == 5 and b >= 2 * x.nbytes]
    assert body and body[0][0] == 5 * 2 * x.nbytes
    parts = S.by_part(ops)
    assert sum(b for b, _ in parts.values()) == sum(b for _, _, b, _ in ops)


def test_a_cast_reads_its_whole_operand():
    """A fusion that only converts (fp32 master weights to their bf16 copy) reads the fp32 array
    and writes the bf16 one: 6 bytes per element, not the 2 of its output alone."""
    x = jnp.ones((256, 256), jnp.float32)
    ops = _ops(lambda x: x.astype(jnp.bfloat16).reshape(128, 512), x)
    assert sum(b for _, _, b, _ in ops) == x.nbytes + x.size * 2


def test_operands_a_kernel_updates_in_place_are_not_counted_whole():
    """A call whose outputs alias operands (`output_to_operand_aliasing`: a kernel's mutable refs,
    e.g. the dW kernel writing one layer's rows of the stacked gradient) counts its other
    operands read and as much written, not the aliased buffers whole; on the call or on the root
    of the computation it calls (whose parameters map to the call's operands)."""
    text = "\n".join([
        "%fused (p0: f32[1024], p1: f32[1048576]) -> f32[1048576] {",
        "  %p0 = f32[1024]{0} parameter(0)",
        "  %p1 = f32[1048576]{0} parameter(1)",
        '  ROOT %k = f32[1048576]{0} custom-call(%p0, %p1), custom_call_target="k", '
        "output_to_operand_aliasing={{}: (1, {})}",
        "}",
        "",
        "ENTRY %main (x: f32[1024], r: f32[1048576], s: f32[4096]) -> (f32[1048576], f32[4096]) {",
        "  %x = f32[1024]{0} parameter(0)",
        "  %r = f32[1048576]{0} parameter(1)",
        "  %s = f32[4096]{0} parameter(2)",
        '  %c = (f32[1048576]{0}, f32[4096]{0}) custom-call(%x, %r, %s), custom_call_target="k", '
        "output_to_operand_aliasing={{0}: (1, {}), {1}: (2, {})}",
        "  %f = f32[1048576]{0} fusion(%x, %r), kind=kCustom, calls=%fused",
        "  %e = f32[1024]{0} exponential(%x)",
        "  ROOT %t = (f32[1048576]{0}, f32[4096]{0}) tuple(%f, %s)",
        "}",
    ])
    comps, _ = S.parse_hlo(text)
    assert S._aliased_operands(comps["main"][3][5], []) == [1, 2]
    assert S._aliased_operands(comps["main"][4][5], comps["fused"]) == [1]
    assert S._aliased_operands(comps["main"][5][5], []) == []
    moved = {name: b for name, _, b, _ in S.hlo_bytes(text)}
    assert moved == {"c": 2 * 4096, "f": 2 * 4096, "e": 2 * 4096}
