"""A stand-in accelerator for CPU tests: models and buffers put on the `meta` device play the GPU.

`OnDevice()` is a dispatch mode that makes `meta` behave as CUDA does where it matters here:
- an op whose tensor arguments sit on different devices raises, as CUDA does (0-dim tensors
  excepted, as CUDA excepts CPU scalars); plain meta kernels let some of these through (an
  embedding looked up with CPU indices);
- results read back to the host come back as stand-ins instead of failing, so a worker's whole
  step runs: a scalar (`.item()`, `float()`, `bool()`) as 1 / 1.0 / True, a tensor (`.cpu()`,
  `.to("cpu")`) as zeros of its shape and dtype.
Nothing is computed on meta, so values are not checked here, only where tensors live; a worker
plans on the host what depends on values (row widths, which rows share a prompt)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# ops that legitimately take tensors from two devices (copies between host and device)
_CROSS_DEVICE = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten._copy_from.default,
                 torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default,
                 torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class DeviceMismatch(RuntimeError):
    pass


class OnDevice(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return True if args[0].dtype == torch.bool else 1 if not args[0].is_floating_point() else 1.0
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "meta" \
                and torch.device(kwargs.get("device") or "meta").type == "cpu":
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if func is torch.ops.aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type == "meta":
            return args[0].zero_()
        if func not in _CROSS_DEVICE:
            devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0}
            if len(devices) > 1:
                raise DeviceMismatch(f"{func}: tensors on {sorted(map(str, devices))}")
        return func(*args, **kwargs)
