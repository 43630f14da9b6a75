"""The train_step.py step compiled for an H200 by XLA's GPU compiler, on a machine without a GPU:
its peak memory and the HBM bytes of each part of the step, to check a change before a GPU run.

    pip install "jax[cuda13]==0.11.2"    # the CUDA plugin compiles; no GPU or driver needed
    python benchmarks/step_bytes.py [--layers 4] [--dsjax matched] [--set KEY=VALUE ...]
        [--paired KEY=VALUE ...] [--top N] [--hlo DIR]

How: a one-device GPU topology described by benchmarks/h200_target_config.txtpb
(`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`), the
kernels targeted at its compile-only device (`pallas_kernels._hopper.target_device`: dispatch
and Mosaic lowering as on the H200), and train_step.py's model rows (`_step_common`) and batch
(V2-Lite geometry, B4 x T2048) compiled by `dsjax.plan.compile_memory`. Nothing runs.

Prints per row: the compiled peak (argument + output - alias + temp; the 4- and 8-layer steps
with bf16 weights and moments and fp32 logits give 20.69 and 40.73 GB here, 20.7 and 40.8 GB
from the H200's allocator: benchmarks/RESULTS.md, "Step bytes"), then the bytes each part of the
step moves: every op it launches (fusion, custom call, copy; ops in loops times the trip count)
counts its operands and results, except operands it only gathers or slices (their slices) and
in-place updates (the update). Parts are train_step.py's profile parts
(`_step_common.classify`). For the memory-bound parts the time is about bytes / bandwidth
(`--tbps`; the profiled H200 steps move their optimizer, loss and norm bytes at 3.6-4.1 TB/s);
GEMM and kernel rows are compute-bound and their bytes an upper bound.
`--paired KEY=VALUE ...` compiles each row again with the overrides and prints the change.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _step_common import DSJAX_ROWS, INSTR, V2_LITE, classify, row_label, stack_tables  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
COMPUTE_WORDS = ("GEMMs", "kernels")  # parts whose time is not their bytes
_DT = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
       "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_DT) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_FREE = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier")  # ops that move no bytes
_ALLOCATE = 'custom_call_target="AllocateBuffer"'  # an uninitialised buffer: no bytes either


def type_bytes(t: str) -> int:
    """Bytes of the arrays in an HLO type string, e.g. "(f32[4,8]{1,0}, bf16[2])" -> 132."""
    total = 0
    for dt, dims in _SHAPE.findall(t):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DT[dt]
    return total


def _split(rhs: str):
    """'TYPE OPCODE(OPERANDS), ATTRS' -> (TYPE, OPCODE, [operand names], ATTRS)."""
    depth = 0
    for i, ch in enumerate(rhs):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == " " and depth == 0:
            ty, rest = rhs[:i], rhs[i + 1:]
            break
    else:
        return rhs, "", [], ""
    op, _, args = rest.partition("(")
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return ty, op, re.findall(r"%([\w.\-]+)", args[:end]), args[end:]


def parse_hlo(text: str):
    """Compiled HLO text -> ({computation: [(name, type, opcode, operands, attrs, line)]}, entry)."""
    comps, cur, entry = {}, None, None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            entry = cur if m.group(1) else entry
        elif line == "}":
            cur = None
        elif cur is not None and (m := INSTR.match(line)):
            comps[cur].append((m.group(1), *_split(m.group(2)), m.group(2)))
    return comps, entry


def _read_bytes(comp: list) -> dict:
    """Parameter index -> bytes a fused computation reads of it, where every use (through
    bitcasts, reshapes, converts and roundings, which the fusion computes per element used) is
    the sliced operand of a gather, dynamic slice or static slice (e.g. one layer of a stacked weight
    that a kernel's fusion takes); other parameters are absent (read whole)."""
    users, params, types = collections.defaultdict(list), {}, {}
    for name, ty, op, operands, attrs, line in comp:
        types[name] = ty
        if op == "parameter":
            params[name] = int(re.search(r"parameter\((\d+)\)", line).group(1))
        for j, o in enumerate(operands):
            users[o].append((name, op, j))
    out = {}
    for p, i in params.items():
        todo, total, sliced = [p], 0, bool(users.get(p))
        while todo and sliced:
            node = todo.pop()
            if not users.get(node):  # a value the fusion returns: read whole
                sliced = False
            for name, op, j in users.get(node, []):
                if op in ("bitcast", "reshape", "convert", "reduce-precision"):
                    todo.append(name)
                elif op in ("gather", "dynamic-slice", "slice") and j == 0:
                    total += type_bytes(types[name])
                else:
                    sliced = False
        if sliced:  # several slices of one operand read at most all of it
            out[i] = min(total, type_bytes(types[p]))
    return out


def _aliased_operands(line: str, inner: list) -> list:
    """Operand indices of an op whose outputs alias them (`output_to_operand_aliasing`, on the
    op or on the root of the computation it calls; a called root's operands that are its
    parameters map to the op's operands)."""
    for text, names in [(line, None)] + ([(inner[-1][5], inner[-1][3])] if inner else []):
        m = re.search(r"output_to_operand_aliasing=\{(.*?\))\}", text)
        if not m:
            continue
        idx = [int(k) for k in re.findall(r"\}: \((\d+),", m.group(1))]
        if names is None:
            return idx
        params = {n: int(re.search(r"parameter\((\d+)\)", ln).group(1))
                  for n, _, op, _, _, ln in inner if op == "parameter"}
        return [params[names[k]] for k in idx if k < len(names) and names[k] in params]
    return []


def hlo_bytes(text: str) -> list:
    """The ops a compiled step launches: [(name, part, bytes moved per step, launches per step)]."""
    comps, entry = parse_hlo(text)
    chain = stack_tables(text)
    ops = []

    def walk(comp: str, times: int):
        types = {}
        for name, ty, op, operands, attrs, line in comps[comp]:
            types[name] = ty
            if op in _FREE or _ALLOCATE in attrs:
                continue
            if op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
                walk(re.search(r"body=%?([\w.\-]+)", attrs).group(1), times * int(trips.group(1) if trips else 1))
                continue
            if op in ("call", "conditional"):
                for c in re.findall(r"(?:to_apply=|calls=|branch_computations=\{)%?([\w.\-]+)", attrs):
                    walk(c, times)
                continue
            read = [type_bytes(types.get(o, "")) for o in operands]
            written = type_bytes(ty)
            called = re.search(r"calls=%?([\w.\-]+)", attrs)
            inner = comps.get(called.group(1), []) if called else []
            for i, b in _read_bytes(inner).items() if op == "fusion" else ():
                read[i] = b
            aliased = _aliased_operands(line, inner)
            in_place = (op == "dynamic-update-slice" or (inner and inner[-1][2] == "dynamic-update-slice"))
            if aliased and read:  # buffers updated in place (a kernel's refs): neither read nor written whole
                for i in aliased:
                    read[i] = 0
                written = sum(read)
            elif in_place and read:  # the big updated buffer is neither read nor written whole
                big = max(range(len(read)), key=read.__getitem__)
                written = sum(read) - read[big]
                read[big] = 0
            fid = re.search(r"stack_frame_id=(\d+)", line)
            text_for_part = line + (" mosaic_gpu" if any("mosaic_gpu" in x[5] for x in inner) else "")
            part = classify(name, text_for_part, chain(int(fid.group(1))) if fid else [])
            ops.append((name, part, (sum(read) + written) * times, times))

    walk(entry, 1)
    return ops


def compute_bound(part: str) -> bool:
    """GEMM and kernel parts: their time is their FLOPs, not their bytes."""
    return any(w in part for w in COMPUTE_WORDS)


def by_part(ops: list) -> dict:
    """{part: (bytes, launches)}, largest first."""
    acc = collections.defaultdict(lambda: [0, 0])
    for _, part, b, n in ops:
        acc[part][0] += b
        acc[part][1] += n
    return dict(sorted(((k, tuple(v)) for k, v in acc.items()), key=lambda kv: -kv[1][0]))


def compile_row(args, row: str, extra: tuple = ()) -> dict:
    """Compile one row for the target; returns compile_memory's dict (with "hlo")."""
    from jax.experimental import topologies

    from dsjax import config as C
    from dsjax.plan import compile_memory
    from pallas_kernels._hopper import target_device

    with open(args.target) as f:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=f.read())
    dev = topo.devices[0]
    sets = V2_LITE + [f"model.num_hidden_layers={args.layers}", f"data.seq_len={args.seq}",
                      f"data.batch_size={args.batch}"] + DSJAX_ROWS[row] + args.set + list(extra)
    cfg = C.load(None, sets)
    with target_device(dev):
        return compile_memory(cfg, 1, devices=[dev], hopper_kernels=False, hlo=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dsjax", default="matched", help=f"comma list of {sorted(DSJAX_ROWS)}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every row")
    p.add_argument("--paired", nargs="+", default=[], metavar="KEY=VALUE",
                   help="compile each row again with these overrides and print the change")
    p.add_argument("--tbps", type=float, default=4.0, help="HBM rate for the memory-bound parts, TB/s")
    p.add_argument("--top", type=int, default=12, help="largest memory-bound ops to list per row")
    p.add_argument("--hlo", default="", help="write each compiled module to DIR/ROW.hlo.txt")
    p.add_argument("--target", default=os.path.join(HERE, "h200_target_config.txtpb"))
    args = p.parse_args(argv)
    # before jax starts: the CUDA plugin without a driver compiles only, no GPU client
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    rows = [r for r in args.dsjax.split(",") if r]
    variants = [(r, e) for r in rows for e in ([()] + ([tuple(args.paired)] if args.paired else []))]
    results = []
    for row, extra in variants:
        label = row_label(row, extra)
        res = compile_row(args, row, extra)
        ops = hlo_bytes(res["hlo"])
        results.append((label, res, ops))
        if args.hlo:
            os.makedirs(args.hlo, exist_ok=True)
            with open(os.path.join(args.hlo, re.sub(r"[^\w.=-]+", "_", label) + ".hlo.txt"), "w") as f:
                f.write(res["hlo"])
        print(f"compiled {label}: peak {res['peak'] / 1e9:.3f} GB", flush=True)

    print(f"\n{args.layers} layers, B{args.batch} x T{args.seq}, compiled for {os.path.basename(args.target)}; "
          f"ms = bytes / {args.tbps} TB/s (memory-bound parts only)")
    print(f"{'row':<58} {'peak GB':>8} {'temp GB':>8} {'moved GB':>9} {'mem-bound ms':>12}")
    for label, res, ops in results:
        parts = by_part(ops)
        mem = sum(b for k, (b, _) in parts.items() if not compute_bound(k))
        print(f"{label:<58} {res['peak'] / 1e9:8.3f} {res['temp'] / 1e9:8.3f} "
              f"{sum(b for b, _ in parts.values()) / 1e9:9.2f} {mem / args.tbps / 1e9:12.2f}")
    names = list(dict.fromkeys(k for _, _, ops in results for k in by_part(ops)))
    print(f"\n{'part (GB moved per step)':<40}" + "".join(f" {i:>9}" for i in range(len(results)))
          + ("   change" if args.paired else ""))
    for k in names:
        vals = [by_part(ops).get(k, (0, 0))[0] / 1e9 for _, _, ops in results]
        line = f"{k[:40]:<40}" + "".join(f" {v:9.2f}" for v in vals)
        if args.paired:
            line += "   " + " ".join(f"{vals[i + 1] - vals[i]:+.2f}" for i in range(0, len(vals), 2))
        print(line)
    print("columns: " + "; ".join(f"{i} = {label}" for i, (label, _, _) in enumerate(results)))
    for label, _, ops in results:
        mem_ops = sorted((o for o in ops if not compute_bound(o[1])), key=lambda o: -o[2])
        print(f"\n{label}: largest memory-bound ops (GB per step, launches)")
        for name, part, b, n in mem_ops[:args.top]:
            print(f"  {b / 1e9:7.3f} x{n:<3} {name[:44]:<44} {part}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
