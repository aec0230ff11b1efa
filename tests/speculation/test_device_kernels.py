"""The device drafter's Triton kernels (rlspec/speculation/history/device/kernels.py) without a GPU:
in Triton's interpreter, the count table's walk against CountTable.draft on random tables (drafts
token for token, the walk's match length) and the drafter with its kernels against its torch code
on random traces; and every kernel compiled by Triton for the GPUs rlspec targets (sm_90: H100;
sm_100: GB200) down to a cubin, which the interpreter does not do (a type the compiler refuses, a
loop-carried value changing type, fail there)."""
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

out = {}
for name, (sig, consts, warps) in K.SIGNATURES.items():
    fn = getattr(K, name)
    full = {**sig, **{c: "constexpr" for c in consts}}
    assert list(full) == fn.arg_names, (name, fn.arg_names)
    sizes = {}
    for arch in ARCHS:
        c = triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                           options={"enable_fp_fusion": False, "num_warps": warps})
        sizes[arch] = len(c.asm["cubin"])
    out[name] = sizes
print(json.dumps(out))
'''


@pytest.mark.slow   # (about a minute: six kernels, two targets)
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
    assert sorted(sizes) == ["_append", "_choose", "_count_walk", "_gather", "_live_lookup", "_own_draft"]
    assert all(sizes[k][str(a)] > 1000 for k in sizes for a in archs), sizes


OWN = r'''
import random, torch
from rlspec.speculation.history.device.store import DeviceHistory, prompt_hash
from tests.speculation.test_device_history import batch, cut_rows, trace
checked = drafted = 0
for seed in range(SEEDS):
    g = random.Random(100 + seed)
    h = DeviceHistory(max_tokens=g.choice([120, 300, 2000]), buckets=g.choice([4, 16, 256]), width=g.choice([2, 4, 8]),
                      max_match=6, prompt_keys=g.choice([(4, 2), (4, 2, 1), (3,)]), min_prob=g.choice([0.3, 0.5, 0.8]),
                      max_siblings=g.choice([2, 3, 5]), max_voters=g.choice([1, 2, 5, 64]),
                      global_source=g.random() < 0.5, kernels=False)
    for call in trace(seed, vocab=g.choice([4, 6, 10])):
        rows, plens = cut_rows(g, call)
        tok, n, pid, pl = batch(rows, plens, max(map(len, rows)) + g.randrange(3))
        done = g.randrange(0, 3)   # the last rows: finished answers, read by their siblings
        act = torch.tensor([g.random() < 0.9 for _ in rows])
        for k in (1, 3, 5):
            h.kernels = False
            want = h.propose(tok, n, pid, pl, k, act, sources=True, done=done)
            h.kernels = True
            got = h.propose(tok, n, pid, pl, k, act, sources=True, done=done)
            for w, x in zip(want, got):
                assert torch.equal(w, x), (seed, k, w, x)
            checked += len(rows)
            drafted += int(want[1].sum())
        h.insert(*zip(*call))
print("ok", checked, drafted)
'''


@pytest.mark.slow   # (about a minute in the interpreter; the default suite has the slot rows' kernel test)
def test_the_own_draft_kernel_drafts_what_the_torch_drafter_drafts():
    """DeviceHistory.propose with its kernels (kernels.own_draft and count_walk, Triton's
    interpreter) against its torch code on the random traces of test_device_history.py: rings
    small enough to overwrite, buckets of 2 to 8 entries overflowing, a voter bound of 1 to 64,
    finished rows read by their siblings, inactive rows; drafts, counts and sources token for token."""
    run = subprocess.run([sys.executable, "-c", OWN.replace("SEEDS", "8")], cwd=ROOT, text=True,
                         capture_output=True, timeout=900, env={**child_env(), "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    ok, checked, drafted = run.stdout.split()
    assert ok == "ok" and int(checked) > 1000 and int(drafted) > 300, run.stdout
