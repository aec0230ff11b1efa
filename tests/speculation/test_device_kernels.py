"""The device drafter's Triton kernels (rlspec/speculation/history/device/kernels.py) without a GPU:
the count table's walk in Triton's interpreter against CountTable.draft on random tables (drafts
token for token, the walk's match length), and every kernel compiled by Triton for the GPUs rlspec
targets (sm_90: H100; sm_100: GB200) down to a cubin, which the interpreter does not do (a type
the compiler refuses, a loop-carried value changing type, fail there)."""
import subprocess
import sys

import pytest

from conftest import ROOT, child_env

WALK = r'''
import random, torch
from rlspec.speculation.history.device.counts import CountTable
from rlspec.speculation.history.device import kernels
checked = drafted = 0
for seed in range(SEEDS):
    g = random.Random(seed)
    vocab = g.choice([3, 5, 9, 1000])
    keys = g.choice([(1, 2, 3, 4, 5, 6), (1, 3, 6), (2, 5), (1, 6), (4,)])
    t = CountTable("cpu", keys, g.choice([2, 4, 16]), g.choice([1, 8, 64]), g.choice([0.05, 0.2, 0.5]),
                   g.choice([vocab, 2]))   # a vocabulary bound below the tokens: walks stop at it
    for _ in range(g.randrange(0, 30)):   # sequences [head | answer | END] counted in, some out
        body = [g.randrange(min(vocab, 9)) for _ in range(g.randrange(3, 30))]
        args = torch.tensor(body), torch.tensor([len(body)]), torch.tensor([min(g.randrange(4), len(body))])
        t.add(*args, 1)
        if g.random() < 0.2:
            t.add(*args, -1)
    B, M, k = 40, 6, g.choice([1, 3, 5, 7])
    n = torch.tensor([g.randrange(0, 12) for _ in range(B)])
    ctx = torch.tensor([[g.randrange(min(vocab, 9)) for _ in range(M)] for _ in range(B)])
    ctx = torch.where(torch.arange(M)[None] < n[:, None], ctx, -5)
    act = torch.tensor([g.random() < 0.8 for _ in range(B)])
    want, want_m = t.draft(ctx, n, k)
    want = torch.where(act[:, None], want, -1)
    got, got_m = kernels.count_walk(t, ctx, n, k, act)
    assert torch.equal(got, want), (seed, got, want)
    assert torch.equal(got_m[act], want_m[act]), (seed, got_m, want_m)
    checked += B
    drafted += int((want >= 0).sum())
print("ok", checked, drafted)
'''


def test_the_count_walk_kernel_drafts_what_the_count_table_drafts():
    """kernels.count_walk in Triton's interpreter (a child process: TRITON_INTERPRET=1 before
    Triton is imported) against CountTable.draft: 12 random tables (count lengths contiguous and
    sparse, full buckets, counts taken out again, a vocabulary bound), 40 rows each, k of 1 to 7."""
    run = subprocess.run([sys.executable, "-c", WALK.replace("SEEDS", "12")], cwd=ROOT, text=True,
                         capture_output=True, timeout=900, env={**child_env(), "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    ok, checked, drafted = run.stdout.split()
    assert ok == "ok" and int(checked) == 480 and int(drafted) > 100, run.stdout


COMPILE = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rlspec.speculation.history.device import kernels as K

SIGS = {
    "_latest": ({"fp_ptr": "*i64", "used_ptr": "*i1", "head_ptr": "*i32", "prev_ptr": "*i32", "slot_ptr": "*i64",
                 "q_ptr": "*i64", "n_ptr": "*i64", "lo_ptr": "*i64", "out_ptr": "*i64", "N": "i32", "li": "i32"},
                {"K": 3, "H": 65536, "LP": 18433, "BLOCK": K.BLOCK}),
    "_append": ({"fp_ptr": "*i64", "used_ptr": "*i1", "head_ptr": "*i32", "prev_ptr": "*i32", "tok_ptr": "*i32",
                 "tok_stride": "i64", "slot_ptr": "*i64", "lo_ptr": "*i64", "hi_ptr": "*i64", "keys_ptr": "*i64"},
                {"K": 3, "H": 65536, "LP": 18433}),
    "_count_walk": ({"ctx_ptr": "*i64", "n_ptr": "*i64", "act_ptr": "*i8", "levels_ptr": "*i64", "key_ptr": "*i64",
                     "tok_ptr": "*i32", "cnt_ptr": "*i32", "out_ptr": "*i32", "m_ptr": "*i64",
                     "min_prob_ptr": "*fp64", "vocab": "i64", "NB": "i64"},
                    {"M": 16, "LV": 16, "K": 5, "W": 16, "MB": 16, "KB": 8, "WB": 16}),
}
out = {}
for name, (sig, consts) in SIGS.items():
    fn = getattr(K, name)
    full = {**sig, **{c: "constexpr" for c in consts}}
    assert list(full) == fn.arg_names, (name, fn.arg_names)
    sizes = {}
    for arch in ARCHS:
        c = triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                           options={"enable_fp_fusion": False})
        sizes[arch] = len(c.asm["cubin"])
    out[name] = sizes
print(json.dumps(out))
'''


@pytest.mark.parametrize("archs", [[90, 100]])
def test_every_kernel_compiles_for_the_gpus_rlspec_targets(archs):
    """Each kernel of kernels.py, at the 8B experiment's shapes (three prompt key lengths, rows
    18,432 tokens wide, count lengths 1..16, k=5), compiled by Triton to a cubin for sm_90 and
    sm_100 on this machine (Triton's own ptxas; no GPU or driver needed): the signatures here
    list every argument the kernel takes, in order."""
    import json

    code = COMPILE.replace("ARCHS", repr(archs))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, timeout=900,
                         env=child_env())
    assert run.returncode == 0, run.stderr[-3000:]
    sizes = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(sizes) == ["_append", "_count_walk", "_latest"]
    assert all(sizes[k][str(a)] > 1000 for k in sizes for a in archs), sizes
