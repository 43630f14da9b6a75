"""Expert-parallel token exchanges side by side: bytes moved, compiled memory and time.

    python benchmarks/ep_exchange.py                       # 8 fake CPU devices (default here)
    python benchmarks/ep_exchange.py --tokens 4096 --dim 7168 --platform gpu

Every variant moves each rank's n tokens [n, D] (top-K of E experts, El = E / ep per rank) to
the ranks holding their experts, applies a per-expert scale (a stand-in for the expert FFN, so
that the exchange dominates) and returns the weighted sum of the K results to the token's rank.
All are dropless and give the same output (checked):
  all_gather    our dispatch (`sharding.expert_parallel`): all-gather tokens and routing over
                the ep ranks, compute the local experts' rows, `psum_scatter` the fp32 sums back.
                Moves (ep-1) x n x D in and (ep-1) x n x D fp32 partial sums out, whatever K.
  ragged_a2a    `jax.lax.ragged_all_to_all` of the routed copies sorted by destination rank,
                then back: (ep-1)/ep x n x K x D each way on average; the receive buffer must
                hold the worst case, ep x n x min(K, El) rows, to stay dropless.
  dense_a2a     `jax.lax.all_to_all` with a worst-case slot per destination (n x min(K, El)
                rows each): ep x n x min(K, El) x D each way, whatever the routing.
Prints, per variant, the bytes one rank sends per call, the compiled temporary bytes per
device and the median wall time of the jitted forward.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank (n)")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--platform", default="cpu")
    a = ap.parse_args(argv)
    if a.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={a.ep}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    ep, n, D, E, K = a.ep, a.tokens, a.dim, a.experts, a.topk
    El = E // ep
    cap = n * min(K, El)  # worst-case rows one rank can send to (or receive from) another
    mesh = Mesh(np.asarray(jax.devices()[:ep]), ("ep",))
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(ep * n, D)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(r.random((ep * n, E)), axis=-1)[:, :K], jnp.int32)
    w = jnp.asarray(r.random((ep * n, K)), jnp.float32)
    scale = jnp.asarray(1.0 + r.random(E), jnp.float32)
    sh = NamedSharding(mesh, P("ep"))
    x, ids, w = (jax.device_put(v, sh) for v in (x, ids, w))

    def all_gather(x, ids, w, scale):
        xa = jax.lax.all_gather(x, "ep", axis=0, tiled=True)
        ia = jax.lax.all_gather(ids, "ep", axis=0, tiled=True)
        wa = jax.lax.all_gather(w, "ep", axis=0, tiled=True)
        e0 = jax.lax.axis_index("ep") * El
        mine = (ia >= e0) & (ia < e0 + El)
        f = jnp.sum(jnp.where(mine, wa * scale[ia], 0.0), axis=1)  # [ep n]
        y = xa.astype(jnp.float32) * f[:, None]
        return jax.lax.psum_scatter(y, "ep", scatter_dimension=0, tiled=True)

    def _routing(ids):
        dest = (ids // El).reshape(-1)  # [n K] destination rank of each copy
        order = jnp.argsort(dest, stable=True)
        send = jnp.bincount(dest, length=ep).astype(jnp.int32)
        in_off = (jnp.cumsum(send) - send).astype(jnp.int32)
        recv = jax.lax.all_to_all(send, "ep", 0, 0, tiled=True)  # rows each rank sends me
        # where my rows land in each receiver's buffer: the sum of what lower ranks send it
        before = jax.lax.all_gather(send, "ep")  # [ep src, ep dst]
        me = jax.lax.axis_index("ep")
        out_off = jnp.sum(jnp.where(jnp.arange(ep)[:, None] < me, before, 0), axis=0).astype(jnp.int32)
        return order, send, in_off, recv, out_off

    def ragged_a2a(x, ids, w, scale):
        order, send, in_off, recv, out_off = _routing(ids)
        rows = jnp.take(x, order // K, axis=0)
        eid = jnp.take(ids.reshape(-1), order)
        buf = jnp.zeros((ep * cap, D), x.dtype)
        got = jax.lax.ragged_all_to_all(rows, buf, in_off, send, out_off, recv, axis_name="ep")
        gid = jax.lax.ragged_all_to_all(eid, jnp.zeros((ep * cap,), eid.dtype), in_off, send,
                                        out_off, recv, axis_name="ep")
        y = (got.astype(jnp.float32) * scale[gid][:, None]).astype(x.dtype)
        # back: what I received from rank j returns to j at the offsets it sent from
        r_in = (jnp.cumsum(recv) - recv).astype(jnp.int32)
        back_off = jax.lax.all_to_all(in_off, "ep", 0, 0, tiled=True)
        ret = jax.lax.ragged_all_to_all(y, jnp.zeros_like(rows), r_in, recv, back_off, send,
                                        axis_name="ep")
        slot = jnp.zeros((n * K,), jnp.int32).at[order].set(jnp.arange(n * K, dtype=jnp.int32))
        yk = jnp.take(ret, slot, axis=0).reshape(n, K, D).astype(jnp.float32)
        return jnp.einsum("nkd,nk->nd", yk, w)

    def dense_a2a(x, ids, w, scale):
        dest = (ids // El).reshape(-1)
        order = jnp.argsort(dest, stable=True)
        send = jnp.bincount(dest, length=ep)
        start = jnp.cumsum(send) - send
        sd = jnp.take(dest, order)
        pos = jnp.arange(n * K) - jnp.take(start, sd)
        slot_of = sd * cap + pos  # slot of sorted copy i in the [ep, cap] send buffer
        buf = jnp.zeros((ep * cap, D), x.dtype).at[slot_of].set(jnp.take(x, order // K, axis=0))
        eb = jnp.full((ep * cap,), 0, jnp.int32).at[slot_of].set(jnp.take(ids.reshape(-1), order))
        got = jax.lax.all_to_all(buf.reshape(ep, cap, D), "ep", 0, 0, tiled=True)
        gid = jax.lax.all_to_all(eb.reshape(ep, cap), "ep", 0, 0, tiled=True)
        y = (got.astype(jnp.float32) * scale[gid][..., None]).astype(x.dtype)
        back = jax.lax.all_to_all(y, "ep", 0, 0, tiled=True).reshape(ep * cap, D)
        sorted_y = jnp.take(back, slot_of, axis=0)
        slot = jnp.zeros((n * K,), jnp.int32).at[order].set(jnp.arange(n * K, dtype=jnp.int32))
        yk = jnp.take(sorted_y, slot, axis=0).reshape(n, K, D).astype(jnp.float32)
        return jnp.einsum("nkd,nk->nd", yk, w)

    it = jnp.dtype(jnp.bfloat16).itemsize
    sent = {"all_gather": (ep - 1) * n * D * it + (ep - 1) * n * D * 4,
            "ragged_a2a": 2 * int((ep - 1) / ep * n * K) * D * it,
            "dense_a2a": 2 * (ep - 1) * cap * D * it}
    print(f"{ep} ranks ({jax.default_backend()}), n={n} tokens per rank, D={D}, E={E}, K={K}")
    print(f"  {'variant':<11} {'sent/rank MB':>12} {'temp/dev MB':>12} {'ms (median)':>12}  max|diff|")
    ref = None
    for name, fn in (("all_gather", all_gather), ("ragged_a2a", ragged_a2a), ("dense_a2a", dense_a2a)):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P()),
                                  out_specs=P("ep"), check_vma=False))
        try:
            c = f.lower(x, ids, w, scale).compile()
            y = c(x, ids, w, scale).block_until_ready()
        except Exception as err:  # noqa: BLE001 - a backend without this collective: report it
            print(f"  {name:<11} failed: {str(err).splitlines()[0][:120]}")
            continue
        ts = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            c(x, ids, w, scale).block_until_ready()
            ts.append(time.perf_counter() - t0)
        ref = y if ref is None else ref
        diff = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32))))
        temp = c.memory_analysis().temp_size_in_bytes
        print(f"  {name:<11} {sent[name] / 1e6:12.1f} {temp / 1e6:12.1f} "
              f"{sorted(ts)[len(ts) // 2] * 1e3:12.2f}  {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
