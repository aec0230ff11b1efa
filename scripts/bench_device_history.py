"""Drafting cost per engine step of the device-resident history drafter
(rlspec/speculation/history/device/store.py) beside the host store's (rlspec/speculation/history/host/index.py, numba),
on the same store and rows: microseconds per running row, at each batch size, JSON out.

Store: --prompts-stored prompts of 200 tokens, 16 responses each of about --response tokens (noisy
copies of 3 latent answers per prompt over a --vocab vocabulary). Batch: groups of 16 siblings of
stored prompts, each row a fresh noisy answer cut at 256 to --response tokens, in a token buffer of
--width columns (the engine's max_model_len). The device drafter is timed per call (stateless); the
host store per step after a first call that takes the rows in, each later step adding one token a row.
Also the insert of the stored responses, per token (the device's on its device, the host's compiled
functions warmed up first).

On an accelerator the device drafter's step is its kernels' memory traffic; with no GPU here,
--gpu-widths counts it: the step a CUDA device runs (the rows' advance and kernels.step) runs on
the `meta` device at each batch and buffer width (the engine's max_model_len), its kernels'
launches and bytes counted from their grids and every torch op beside them with the bytes it reads
and writes, and the seconds at --hbm bytes/s (at --hbm-efficiency) beside the launches' count.

    python scripts/bench_device_history.py --batches 64 512 --out /tmp/device_history_cost.json
    python scripts/bench_device_history.py --batches 64 512 --gpu-widths 2048 18432 --out /tmp/device_history_cost.json
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np
import torch

import harness

GROUP, PROMPT = 16, 200


def answer(g, latents, vocab):
    base = latents[g.integers(len(latents))]
    noise = g.random(len(base)) < 0.1
    return np.where(noise, g.integers(vocab, size=len(base)), base)


def setup(args, g):
    prompts = [g.integers(args.vocab, size=PROMPT) for _ in range(args.prompts_stored)]
    latents = [[g.integers(args.vocab, size=int(args.response * g.uniform(0.8, 1.2))) for _ in range(3)]
               for _ in prompts]
    stored = [(p, answer(g, lat, args.vocab)) for p, lat in zip(prompts, latents) for _ in range(GROUP)]
    return prompts, latents, stored


def rows_of(args, g, prompts, latents, batch):
    rows, plens = [], []
    for i in range(batch):
        p = i // GROUP % len(prompts)
        r = answer(g, latents[p], args.vocab)
        cut = int(g.integers(256, max(257, len(r) - 16)))
        rows.append(np.concatenate([prompts[p], r[: cut + args.steps + 1]]))
        plens.append(PROMPT)
    return rows, plens, [PROMPT + int(g.integers(256, max(257, args.response - 16))) for _ in range(batch)]


def time_device(args, stored, rows, plens, cuts, lookup: str) -> tuple[float, float]:
    """The device drafter's step on this CPU, as the engine runs it: the rows joined (untimed),
    then each step every row gains a token (LiveRows.step) and is drafted for (propose over the
    rows' slots, lookup scan or table: its torch methods)."""
    from rlspec.speculation.history.device.live import LiveRows
    from rlspec.speculation.history.device.store import DeviceHistory

    h = DeviceHistory(max_tokens=args.arena, max_siblings=GROUP)
    t0 = time.perf_counter()
    h.insert([p for p, _ in stored], [r for _, r in stored])
    insert_s = time.perf_counter() - t0
    B = len(rows)
    src = torch.zeros(B, args.width, dtype=torch.int32)
    n = torch.tensor([min(len(r) - 1 - args.steps, c) for r, c in zip(rows, cuts)])
    for i, r in enumerate(rows):
        src[i, : len(r)] = torch.from_numpy(r.astype(np.int32))
    live = LiveRows(B, 0, args.width, h.prompt_keys, "cpu", table=lookup == "table")
    ids, idx = [str(i) for i in range(B)], torch.arange(B)

    def step(s: int):
        at = live.step(ids, src, idx, n + s, lambda pos: [plens[i] for i in pos], args.k + 1)
        return h.propose(live.tok, live.n[at], live.salt[at], live.plen[at], args.k, sources=True, at=at,
                         table=live.table, siblings=live.siblings(at, min(h.max_siblings, B)))
    step(0)   # the rows join, and a warm-up
    t = []
    for s in range(1, args.steps + 1):
        t0 = time.perf_counter()
        step(s)
        t.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(t)) / B, 1e6 * insert_s / sum(len(r) for _, r in stored)


def time_host(args, stored, rows, plens, cuts) -> float:
    from rlspec.config import HistoryConfig
    from rlspec.config.speculation import history_config
    from rlspec.speculation.history.host.index import HistoryIndex

    h = HistoryIndex(history_config(max_tokens=args.arena), args.k)
    HistoryIndex.warm_up(HistoryConfig(), args.k)
    t0 = time.perf_counter()
    h.record([p for p, _ in stored], [r for _, r in stored], wait=True)
    insert_s = time.perf_counter() - t0
    h.begin_call()
    ids = np.zeros((len(rows), args.width), np.int32)
    n = np.array([min(len(r) - 1 - args.steps, c) for r, c in zip(rows, cuts)])
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    keys = list(range(len(rows)))
    h.propose_rows(ids, n, np.ones(len(rows)), keys, plens, args.k)   # the rows join the live arena
    t = []
    for s in range(1, args.steps + 1):
        t0 = time.perf_counter()
        h.propose_rows(ids, n + s, np.ones(len(rows)), keys, plens, args.k)
        t.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(t)) / len(rows), 1e6 * insert_s / sum(len(r) for _, r in stored)


VIEWS = {"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "transpose", "t",
         "alias", "as_strided", "detach", "lift_fresh", "_reshape_alias", "unbind", "split", "split_with_sizes"}
GATHERS = {"index", "gather", "index_select", "take", "take_along_dim"}
SCATTERS = {"index_put"}


class CountedKernels:
    """kernels.py's launches on the meta device, counted from their grids and block sizes: a launch
    per call; bytes per row, query or position from the loads and stores the kernel makes (a table
    lookup or insert assumed to probe `probes` entries: linear probing at the table's load, at most
    one half). `active` rows draft (the running ones), `new` tokens a row gains."""

    def __init__(self, keys, probes: float, active: int, new: int):
        self.keys, self.probes, self.active, self.new = tuple(keys), probes, active, new
        self.launches, self.bytes = 0, 0.0

    def advance(self, live, slot, src, src_rows, lengths, keys):
        """kernels.advance: per row its slot, source row, length and the slot's length read and
        written, its new tokens read and written; with the table, per new position and key length
        its m tokens, the probes, the head read and written and a link written."""
        B = slot.shape[0]
        self.launches += 1
        self.bytes += B * (5 * 8 + self.new * 8)
        if live.table is not None:
            self.bytes += B * self.new * sum(4 * m + self.probes * 9 + 12 for m in self.keys)

    def gather(self, work, live, at, active, R):
        """kernels.gather: per row its slot (and active flag), its length, salt and prompt length
        read and written, its context's M tokens read (int32) and written (int64)."""
        M = work.ctx.shape[0] // work.rows.shape[0]
        self.launches += 1
        self.bytes += R * (8 + 1 + 3 * 8 + 4 * M) + R * (4 * 8 + 1 + 8 * M)

    def choose(self, work, B, k, far):
        """kernels.choose: per running row the own draft, its ranks, the global draft, both match
        lengths read; the drafts, their count and sources written."""
        self.launches += 1
        self.bytes += B * (4 * k + 8 * k + (4 * k + 16 if far else 0) + 4 * k + 4 + 8 * k)

    def count_walk(self, counts, ctx, n, k, active, out=None, min_prob=None):
        """kernels.count_walk: a program a row; an active row reads its context and at most, from
        every count length, k buckets (W entries of an int64 key, an int32 token and an int32
        count), a row not drafting none."""
        B, M = ctx.shape
        self.launches += 1
        self.bytes += B * (M * 8 + 8 + 1 + 4 * k + 8) + self.active * len(counts.keys) * k * counts.width * 16
        return out

    def own_draft(self, h, rows, ctx, n, salt, p, row, k, active, out=None, consts=None):
        """kernels.own_draft: a program a row; an active row reads its context, its buckets' entries
        (an int64 each) and for every candidate, stored or live, the prompt salt or its row's slot
        and length, max_match tokens before it and k after (int32 each); a row not drafting reads
        its inputs only. Writes its draft, the voters' ranks and its match length."""
        B, M = ctx.shape
        C, GL = len(h.prompt_keys) * h.width, p.shape[1]
        self.launches += 1
        per_active = C * (8 + 8 + 4 * (M + k)) + GL * (4 * 8 + 4 * (M + k))
        self.bytes += B * (M * 8 + 4 * 8 + 1 + k * 12 + 8) + self.active * per_active
        return out

    def live_lookup(self, table, ctx, n, plen, at, sib, listed, out=None, keys=None):
        """kernels.live_lookup: a program a row, reading its context and per sibling (and itself)
        its row's slot, length and prompt length, then per key length its probes, head and perhaps
        a link; writing the positions and rows."""
        B, M = ctx.shape
        G = sib.shape[1] + 1
        self.launches += 1
        self.bytes += B * (M * 8 + 8) + B * G * (8 + 1 + 3 * 8) + B * G * len(self.keys) * (
            self.probes * 9 + 4 + 4 + 2 * 8)
        return out


STAND_INS = ("advance", "gather", "choose", "count_walk", "own_draft", "live_lookup")


def traffic(batch: int, width: int, k: int, arena: int, lookup: str, probes: float) -> dict:
    """One engine step of the device drafter, as a CUDA device runs it, on the meta device at the
    engine's largest shape: `batch` running rows `width` // 2 long (a buffer `width` columns wide:
    the engine's max_model_len) and as many finished answers kept, each running row gaining k + 1
    tokens (LiveRows._advance: kernels.advance) and drafting (the proposer's draft_rows:
    kernels.step). kernels.py's launches are counted from their grids (CountedKernels); every torch
    op dispatched beside them (the whole-row scan under lookup=scan) is counted with the bytes it
    reads and writes (an indexing op the elements it gathers, a view none)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlspec.speculation.history.device import kernels
    from rlspec.speculation.history.device.live import LiveRows
    from rlspec.speculation.history.device.proposer import draft_rows
    from rlspec.speculation.history.device.store import DeviceHistory

    def nbytes(x) -> int:
        return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.bytes = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__.rstrip("_")
            if name in VIEWS:
                return out
            outs = out if isinstance(out, (tuple, list)) else [out]
            written = sum(map(nbytes, outs))
            flat = [a for a in args if isinstance(a, torch.Tensor)] + \
                [t for a in args if isinstance(a, (tuple, list)) for t in a if isinstance(t, torch.Tensor)]
            if name in GATHERS:   # the source tensor is read at the gathered elements only
                read = written + sum(nbytes(t) for t in flat[1:])
            elif name in SCATTERS:   # index_put: the destination is written at the indexed elements only
                written = nbytes(args[2])
                read = written + sum(nbytes(i) for i in args[1] if i is not None)
            else:
                read = sum(map(nbytes, flat))
            self.ops += 1
            self.bytes += read + written
            return out

    h = DeviceHistory(device="meta", max_tokens=arena, max_siblings=GROUP, kernels=True)
    live = LiveRows(batch, batch, width, h.prompt_keys, "meta", table=lookup == "table", kernels=True)
    drafter = SimpleNamespace(live=live, history=h, work=kernels.Workspace(h, live, k))
    counted = CountedKernels(h.prompt_keys, probes, batch, k + 1)
    saved = {name: getattr(kernels, name) for name in STAND_INS}
    for name in STAND_INS:
        setattr(kernels, name, getattr(counted, name))
    at = torch.arange(batch, device="meta")
    live.done = list(range(batch, 2 * batch))   # a full ring of finished answers
    src = torch.zeros(batch, width, dtype=torch.int32, device="meta")   # the runner's token rows
    lengths = torch.full((batch,), width // 2 + k + 1, dtype=torch.int64, device="meta")
    act = torch.ones(batch, dtype=torch.bool, device="meta")
    try:
        draft_rows(drafter, at, act, k)   # a step before: the rows' siblings kept, as while the batch is the same
        counted.launches, counted.bytes = 0, 0.0
        with Count() as c:
            live._advance(at, src, at, lengths, k + 1)   # the step's new tokens into the rows
            draft_rows(drafter, at, act, k)   # the proposer's step: the drafts over the rows' slots
    finally:
        for name, f in saved.items():
            setattr(kernels, name, f)
    return {"lookup": lookup, "launches": c.ops + counted.launches, "torch_ops": c.ops,
            "bytes": c.bytes + counted.bytes, "kernel_launches": counted.launches, "kernel_bytes": counted.bytes,
            "working_bytes": drafter.work.nbytes}


def registers(arch: int) -> dict:
    """Each Triton kernel compiled for sm_`arch` at kernels.SIGNATURES' shapes (no GPU: Triton's
    compiler and ptxas): registers a thread and the bytes it spills, from `ptxas -v`."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from rlspec.speculation.history.device import kernels

    out = {}
    for name, (sig, consts, warps) in kernels.SIGNATURES.items():
        full = {**sig, **{c: "constexpr" for c in consts}}
        c = triton.compile(ASTSource(fn=getattr(kernels, name), signature=full, constexprs=consts),
                           target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False, "num_warps": warps})
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(c.asm["ptx"])
            f.flush()
            log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", "/dev/null"],
                                 capture_output=True, text=True, check=True).stderr
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        out[name] = {"warps": warps, "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
                     "spill_store_bytes": int(spill.group(1)), "spill_load_bytes": int(spill.group(2))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--response", type=int, default=1000)
    ap.add_argument("--prompts-stored", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--arena", type=int, default=1 << 21)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch's CPU threads (the host store drafts on one)")
    ap.add_argument("--gpu-widths", type=int, nargs="*", default=[],
                    help="buffer widths at which to count the device drafter's ops and bytes (meta device)")
    ap.add_argument("--hbm", type=float, default=3.35e12, help="memory bandwidth, bytes/s (H100 SXM)")
    ap.add_argument("--hbm-efficiency", type=float, default=0.8, help="its fraction reached (the simulator's eff.hbm)")
    ap.add_argument("--launch-s", type=float, default=2e-6, help="seconds a kernel launch costs, eager")
    ap.add_argument("--probes", type=float, default=2.0,
                    help="table entries a lookup or insert probes (linear probing at a load of at most one half)")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = np.random.default_rng(args.seed)
    prompts, latents, stored = setup(args, g)
    out = {**harness.stamp(), "torch_threads": torch.get_num_threads(), "k": args.k, "width": args.width,
           "stored_tokens": int(sum(len(r) for _, r in stored)), "us_per_row": {}}
    for b in args.batches:
        rows, plens, cuts = rows_of(args, g, prompts, latents, b)
        (dev, dev_ins), (table, _), (host, host_ins) = (time_device(args, stored, rows, plens, cuts, "scan"),
                                                       time_device(args, stored, rows, plens, cuts, "table"),
                                                       time_host(args, stored, rows, plens, cuts))
        out["us_per_row"][b] = {"device_torch_cpu": dev, "device_table_torch_cpu": table, "host_numba": host}
        out["insert_us_per_token"] = {"device_torch_cpu": dev_ins, "host_numba": host_ins}
        print(b, json.dumps(out["us_per_row"][b]), flush=True)
    if args.gpu_widths:
        out["gpu_estimate"] = {"hbm_bytes_per_s": args.hbm, "hbm_efficiency": args.hbm_efficiency,
                               "launch_seconds": args.launch_s, "probes": args.probes, "per_step": {}}
        for w in args.gpu_widths:
            for b in args.batches:
                for lookup in ("scan", "table"):
                    t = traffic(b, w, args.k, args.arena, lookup, args.probes)
                    t["memory_seconds"] = t["bytes"] / (args.hbm * args.hbm_efficiency)
                    t["seconds"] = t["memory_seconds"] + t["launches"] * args.launch_s
                    out["gpu_estimate"]["per_step"][f"{b}x{w} {lookup}"] = t
                    print(f"batch {b} width {w} lookup {lookup}: {t['launches']} launches, {t['bytes'] / 1e9:.3f} GB, "
                          f"{1e3 * t['memory_seconds']:.3f} ms at {args.hbm_efficiency:.0%} of {args.hbm / 1e12:.2f} "
                          f"TB/s, {1e3 * t['seconds']:.3f} ms with {1e6 * args.launch_s:.0f} us a launch", flush=True)
    if args.gpu_widths:
        out["gpu_estimate"]["kernels_sm90"] = registers(90)
        for name, r in out["gpu_estimate"]["kernels_sm90"].items():
            print(f"{name}: {r['registers']} registers a thread at {r['warps']} warps, spills {r['spill_store_bytes']} "
                  f"bytes stored and {r['spill_load_bytes']} loaded a thread", flush=True)
    if args.out:
        harness.write(out, args.out)


if __name__ == "__main__":
    main()
