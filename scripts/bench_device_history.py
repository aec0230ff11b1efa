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
--gpu-widths counts it: propose runs on the `meta` device at each batch and buffer width (the
engine's max_model_len: the drafter reads every row's whole buffer, whatever its length), every op
it dispatches counted with the bytes it reads and writes (an indexing op the elements it gathers,
a view none), and the seconds at --hbm bytes/s (at --hbm-efficiency) beside the launches' count.

    python scripts/bench_device_history.py --batches 64 512 --out /tmp/device_history_cost.json
    python scripts/bench_device_history.py --batches 64 512 --gpu-widths 2048 18432 --out /tmp/device_history_cost.json
"""
from __future__ import annotations

import argparse
import json
import time

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


def time_device(args, stored, rows, plens, cuts) -> float:
    from rlspec.speculation.history.device.store import DeviceHistory, prompt_hash

    h = DeviceHistory(max_tokens=args.arena, max_siblings=GROUP)
    t0 = time.perf_counter()
    h.insert([p for p, _ in stored], [r for _, r in stored])
    insert_s = time.perf_counter() - t0
    ids = torch.zeros(len(rows), args.width, dtype=torch.int32)
    n = torch.tensor([min(len(r) - 1 - args.steps, c) for r, c in zip(rows, cuts)])
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.from_numpy(r.astype(np.int32))
    pl = torch.tensor(plens)
    pid = prompt_hash(ids, pl)
    h.propose(ids, n, pid, pl, args.k, sources=True)   # warm up (sources: as the engine asks)
    t = []
    for s in range(args.steps):
        t0 = time.perf_counter()
        h.propose(ids, n + s, pid, pl, args.k, sources=True)
        t.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(t)) / len(rows), 1e6 * insert_s / sum(len(r) for _, r in stored)


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


def traffic(batch: int, width: int, k: int, arena: int) -> dict:
    """The device drafter's propose on the meta device at `batch` rows of `width` columns: the ops
    it dispatches and the bytes they move (reads and writes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

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
            else:
                read = sum(map(nbytes, flat))
            self.ops += 1
            self.bytes += read + written
            return out

    h = DeviceHistory(device="meta", max_tokens=arena, max_siblings=GROUP)
    ids = torch.zeros(batch, width, dtype=torch.int32, device="meta")
    n = torch.full((batch,), width // 2, dtype=torch.int64, device="meta")
    pl = torch.full((batch,), PROMPT, dtype=torch.int64, device="meta")
    pid = torch.ones(batch, dtype=torch.int64, device="meta")
    with Count() as c:
        h.propose(ids, n, pid, pl, k, sources=True)
    return {"ops": c.ops, "bytes": c.bytes}


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
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = np.random.default_rng(args.seed)
    prompts, latents, stored = setup(args, g)
    out = {**harness.stamp(), "torch_threads": torch.get_num_threads(), "k": args.k, "width": args.width,
           "stored_tokens": int(sum(len(r) for _, r in stored)), "us_per_row": {}}
    for b in args.batches:
        rows, plens, cuts = rows_of(args, g, prompts, latents, b)
        (dev, dev_ins), (host, host_ins) = (time_device(args, stored, rows, plens, cuts),
                                            time_host(args, stored, rows, plens, cuts))
        out["us_per_row"][b] = {"device_torch_cpu": dev, "host_numba": host}
        out["insert_us_per_token"] = {"device_torch_cpu": dev_ins, "host_numba": host_ins}
        print(b, json.dumps(out["us_per_row"][b]), flush=True)
    if args.gpu_widths:
        out["gpu_estimate"] = {"hbm_bytes_per_s": args.hbm, "hbm_efficiency": args.hbm_efficiency, "per_step": {}}
        for w in args.gpu_widths:
            for b in args.batches:
                t = traffic(b, w, args.k, args.arena)
                t["memory_seconds"] = t["bytes"] / (args.hbm * args.hbm_efficiency)
                out["gpu_estimate"]["per_step"][f"{b}x{w}"] = t
                print(f"batch {b} width {w}: {t['ops']} ops, {t['bytes'] / 1e9:.3f} GB, "
                      f"{1e3 * t['memory_seconds']:.3f} ms at {args.hbm_efficiency:.0%} of {args.hbm / 1e12:.2f} TB/s",
                      flush=True)
    if args.out:
        harness.write(out, args.out)


if __name__ == "__main__":
    main()
