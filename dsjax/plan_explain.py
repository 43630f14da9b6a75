"""Which buffers make a compiled step's temporary memory: XLA's buffer assignment, read back.

`dsjax.plan --explain` compiles with XLA dumping (`--xla_dump_to`, `--xla_dump_hlo_as_text`),
which writes, per compiled module:
  *-buffer-assignment.txt  every allocation, and in the temp allocation every HLO value with
                           its byte offset and size;
  *-live-range.txt         each value's live range in the module's flattened schedule
                           (nested scan/while bodies inlined);
  *after_optimizations.txt the scheduled HLO: each instruction's opcode and metadata (op_name,
                           stack_frame_id) plus the FileNames / FileLocations / StackFrames
                           tables that map a stack frame to its source file and line.
`explain(dump_dir)` sweeps the live ranges of the temp values, finds the schedule step where
the bytes in use (the union of the live values' address ranges) peak, and returns the values
live there, largest first, each with its HLO instruction, opcode, shape, op_name and the
source lines that traced it. Values of one buffer (aliases such as a while loop's carry and
its body parameter) share an address range and are counted once.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections import defaultdict

GB = 1e9
_REPO_DIRS = ("dsjax/", "sharding/", "pallas_kernels/")


@dataclasses.dataclass
class Buffer:
    """One HLO value of the temp allocation live at the peak.

    size: bytes; shape: HLO shape text (e.g. `bf16[32768,7168]{1,0}`); name: HLO instruction
    (with `{i}` tuple index when not the whole value); opcode: its HLO opcode (`fusion`,
    `all-gather`, `while`, ...); op_name: the JAX op path from the metadata; source: innermost
    source lines in this repository, `file:line (function)`, innermost first."""

    size: int
    shape: str
    name: str
    opcode: str
    op_name: str
    source: list


def _newest(dump_dir: str, suffix: str, module: str | None) -> str:
    pat = os.path.join(dump_dir, f"*{module or ''}*{suffix}")
    files = sorted(glob.glob(pat), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"plan --explain: no XLA dump matching {pat}")
    return files[-1]


def _temp_values(path: str):
    """(value name -> (offset, size, shape)) of the preallocated-temp allocations, temp bytes."""
    vals, total, in_temp = {}, 0, False
    alloc = re.compile(r"^allocation \d+: size (\d+).*")
    value = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
    with open(path) as f:
        for line in f:
            m = alloc.match(line)
            if m:
                in_temp = "preallocated-temp" in line
                total += int(m.group(1)) if in_temp else 0
                continue
            if line.startswith("Total bytes used") or line.startswith("Used values"):
                break
            if in_temp:
                v = value.match(line)
                if v:
                    vals[v.group(1)] = (int(v.group(3)), int(v.group(2)), v.group(4).strip())
    return vals, total


def _live_ranges(path: str) -> dict:
    out, on = {}, False
    rx = re.compile(r"^\s+(\S+):(\d+)-(\d+)$")
    with open(path) as f:
        for line in f:
            if "BufferLiveRange" in line:
                on = True
                continue
            if on:
                m = rx.match(line)
                if m:
                    out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
                elif line.strip() and not line.startswith(" "):
                    break
    return out


def _hlo_index(path: str):
    """(instruction -> (opcode, op_name, stack_frame_id)), frame id -> [(file, line, fn)] chain."""
    files, fns, locs, frames, instr = {}, {}, {}, {}, {}
    section = None
    tables = {"FileNames": files, "FunctionNames": fns, "FileLocations": locs, "StackFrames": frames}
    ins = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((?:%([\w.\-]+))?")
    with open(path) as f:
        for line in f:
            head = line.strip()
            if head in tables:
                section = head
                continue
            if section and head and head[0].isdigit():
                k, rest = head.split(" ", 1)
                if section in ("FileNames", "FunctionNames"):
                    tables[section][int(k)] = rest.strip('"')
                else:
                    tables[section][int(k)] = dict((a, int(b)) for a, b in re.findall(r"(\w+)=(\d+)", rest))
                continue
            section = None
            m = ins.match(line)
            if m:
                op = re.search(r'op_name="([^"]*)"', line)
                sf = re.search(r"stack_frame_id=(\d+)", line)
                instr[m.group(1)] = (m.group(3), op.group(1) if op else "",
                                     int(sf.group(1)) if sf else 0, m.group(4))

    def chain(fid):
        out, seen = [], set()
        while fid and fid in frames and fid not in seen:
            seen.add(fid)
            loc = locs.get(frames[fid].get("file_location_id", 0), {})
            out.append((files.get(loc.get("file_name_id", 0), "?"), loc.get("line", 0),
                        fns.get(loc.get("function_name_id", 0), "?")))
            parent = frames[fid].get("parent_frame_id", 0)
            fid = parent if parent != fid else 0
        return out
    return instr, chain


def _repo_lines(chain, n=3) -> list:
    out = []
    for file, line, fn in chain:
        rel = next((file[file.index(d):] for d in _REPO_DIRS if d in file), None)
        if rel and "plan" not in rel and "/train/loop.py" not in rel:
            out.append(f"{rel}:{line} ({fn})")
        if len(out) == n:
            break
    return out


def explain(dump_dir: str, module: str = "jit_traced", top: int = 15) -> dict:
    """The temp buffers live at the peak of the newest compiled `module` dumped in dump_dir.

    Returns {"temp": temp allocation bytes, "peak_live": bytes in use at the peak step,
    "step": schedule index of the peak, "buffers": [Buffer] largest first (top),
    "by_source": [(bytes, count, source line)] of all peak buffers grouped by the innermost
    repository line, largest first}.
    Raises FileNotFoundError when the dump lacks a file.
    """
    ba = _newest(dump_dir, "after_optimizations-buffer-assignment.txt", module)
    lr = _newest(dump_dir, "after_optimizations-live-range.txt", module)
    hlo = _newest(dump_dir, "after_optimizations.txt", module)
    vals, temp = _temp_values(ba)
    ranges = _live_ranges(lr)
    events = defaultdict(list)  # step -> [(+1/-1, key, size)]
    for name, (off, size, _) in vals.items():
        key = name if "{" in name else name + "{}"
        if key not in ranges:
            continue
        s, e = ranges[key]
        events[s].append((1, (off, size)))
        events[e + 1].append((-1, (off, size)))
    refs, used, best, best_t = defaultdict(int), 0, -1, 0
    for t in sorted(events):
        for d, k in sorted(events[t]):  # frees (-1) before allocations at the same step
            if d < 0:
                refs[k] -= 1
                if refs[k] == 0:
                    used -= k[1]
            else:
                if refs[k] == 0:
                    used += k[1]
                refs[k] += 1
        if used > best:
            best, best_t = used, t
    instr, chain = _hlo_index(hlo)
    live, seen = [], set()
    for name, (off, size, shape) in vals.items():
        key = name if "{" in name else name + "{}"
        r = ranges.get(key)
        if not r or not (r[0] <= best_t <= r[1]) or (off, size) in seen:
            continue
        seen.add((off, size))
        base = name.split("{")[0]
        opcode, op_name, fid, arg = instr.get(base, ("?", "", 0, None))
        for _ in range(8):  # copies and bitcasts carry no metadata: take their operand's
            if fid or arg not in instr:
                break
            _, op2, fid, arg = instr[arg]
            op_name = op_name or op2
        live.append(Buffer(size, shape, name.replace("{}", ""), opcode, op_name,
                           _repo_lines(chain(fid))))
    live.sort(key=lambda b: -b.size)
    groups = defaultdict(lambda: [0, 0])
    for b in live:
        g = groups[b.source[0] if b.source else f"({b.opcode} {b.op_name.split('/')[-1]})"]
        g[0] += b.size
        g[1] += 1
    by_source = sorted(((v[0], v[1], k) for k, v in groups.items()), reverse=True)
    return {"temp": temp, "peak_live": best, "step": best_t, "buffers": live[:top],
            "by_source": by_source[:top]}


def format_explain(res: dict, title: str = "") -> str:
    """Human-readable table of `explain`'s result."""
    lines = [f"largest temporaries live at the peak{(' of ' + title) if title else ''} "
             f"(schedule step {res['step']}; {res['peak_live'] / GB:.2f} GB live of the "
             f"{res['temp'] / GB:.2f} GB temp allocation):",
             f"  {'GB':>7}  {'shape':<34} {'HLO':<28} source (innermost first) / op_name"]
    for b in res["buffers"]:
        shape = re.sub(r"\{[\d,]*\}", "", b.shape)
        src = " <- ".join(b.source) if b.source else b.op_name[-90:]
        lines.append(f"  {b.size / GB:7.3f}  {shape[:34]:<34} {(b.opcode + ' ' + b.name)[:28]:<28} {src}")
    lines.append("  grouped by innermost source line:")
    for size, n, src in res["by_source"]:
        lines.append(f"  {size / GB:7.3f}  {n:4d} buffers  {src}")
    return "\n".join(lines)
