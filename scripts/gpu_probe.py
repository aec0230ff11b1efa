"""The GPU kit's first, short call on the lent GPU machine (docs/gpu.md): before the rest of the kit
arrives, what the machine is and whether what the kit carries can load there. Needs the machine's
Python (PyTorch, Triton) and the repository only; writes its JSON after every probe.

    python3 scripts/gpu_probe.py --kit .gpu_kit --out "$OUT/gpu_probe.json"    # call 1
    python3 scripts/gpu_probe.py --lib-path    # the CUDA libraries' folders (scripts/gpu_kit_run.sh)

Probes: the part arrived whole (its SHA256 file); GPU and driver (nvidia-smi); PyTorch and its CUDA
(a matrix product on the GPU against the host's); Triton (a kernel compiled and run); the CUDA
libraries vLLM's compiled parts name (libcudart.so.13, libnvrtc.so.13), found in the nvidia-*
packages' lib folders, set on LD_LIBRARY_PATH (the probe restarts itself with it) and loaded; the
sleep-mode allocator (cumem_allocator, carried in the first part) loaded with ctypes and as the
extension module vLLM imports; the symbols _C_stable_libtorch takes from PyTorch and CUDA resolved in
the machine's libraries (the library itself, 52 MiB compressed, comes with the second part, where
`compiled_parts` loads it inside the engine check); vLLM's requirements against the machine's
versions (transformers among them), and where torch, triton, transformers and protobuf come from.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_kit import VLLM_KERNELS

CUDA_LIBS = ("libcudart.so.13", "libnvrtc.so.13")
SYSTEM_LIBS = ("libc.so", "libm.so", "libdl.so", "libstdc++.so", "libgcc_s.so", "libpthread.so", "librt.so",
               "libcuda.so")  # the C runtime's and the driver's: found by soname


def error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"


def lib_dirs() -> list[str]:
    """PyTorch's library folder and every nvidia-* package's folder holding shared libraries."""
    out = []
    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        out.append(str(Path(spec.origin).parent / "lib"))
    nvidia = importlib.util.find_spec("nvidia")
    for loc in (nvidia.submodule_search_locations or []) if nvidia else []:
        for d in sorted(Path(loc).glob("**/lib")):
            if d.is_dir() and any(d.glob("*.so*")) and str(d) not in out:
                out.append(str(d))
    return out


def find(name: str, dirs: list[str]) -> str | None:
    return next((str(Path(d) / name) for d in dirs if (Path(d) / name).exists()), None)


def load_libs(names, dirs: list[str]) -> dict:
    """Each library by its path in `dirs` (by soname where it is the loader's or the driver's),
    loaded globally as a dependency would be."""
    out = {}
    for name in names:
        path = find(name, dirs)
        try:
            if path is None and not name.startswith(SYSTEM_LIBS):
                raise FileNotFoundError(f"not in {len(dirs)} library folders")
            ctypes.CDLL(path or name, mode=ctypes.RTLD_GLOBAL)
            out[name] = {"path": path or name, "loaded": True}
        except OSError as e:
            out[name] = {"path": path, "loaded": False, "error": error(e)}
    return out


def resolve_symbols(needs: dict, dirs: list[str]) -> dict:
    """Whether a compiled part's undefined symbols resolve in the libraries it names, as found here
    (its PyTorch stable-ABI calls in the machine's PyTorch, its CUDA runtime calls in CUDA 13)."""
    libs = load_libs([n for n in needs["needed"] if not n.startswith("ld-linux")], dirs)
    handles = [ctypes.CDLL(None)] + [ctypes.CDLL(v["path"]) for v in libs.values() if v["loaded"]]  # + Python's
    missing = [s for s in needs["symbols"] if not any(has(h, s) for h in handles)]
    return {"libraries": libs, "symbols": len(needs["symbols"]), "missing_count": len(missing),
            "missing_from_torch": [s for s in missing if s.startswith(("aoti_torch", "torch_"))],
            "missing": missing[:20], "resolved": not missing and all(v["loaded"] for v in libs.values())}


def has(lib: ctypes.CDLL, symbol: str) -> bool:
    try:
        lib[symbol]
        return True
    except AttributeError:
        return False


def load_part(path: Path, module: str | None) -> dict:
    """A compiled part loaded with ctypes (the loader names a missing library or symbol), then as
    the extension module vLLM imports (`module`; by its file's name where vLLM is not there yet)."""
    out: dict = {"path": str(path), "present": path.exists()}
    if not path.exists():
        return out
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        out["dlopen"] = True
    except OSError as e:
        out.update(dlopen=False, error=error(e))
        return out
    try:
        if module is not None:
            importlib.import_module(module)
        else:
            spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        out["imported"] = True
    except Exception as e:  # noqa: BLE001 - reported
        out.update(imported=False, error=error(e))
    return out


def compiled_parts() -> dict:
    """vLLM's compiled parts the kit carries, each loaded explicitly (vLLM itself only warns when
    _C_stable_libtorch fails): absent on a CPU build of vLLM."""
    import torch
    import vllm

    site = Path(vllm.__file__).parent.parent
    out = {}
    for rel in VLLM_KERNELS:
        out[rel] = load_part(site / rel, rel.removesuffix(".abi3.so").replace("/", "."))
    c = out[VLLM_KERNELS[0]]
    if c.get("imported"):  # its kernels registered as PyTorch ops
        c["ops_registered"] = all(hasattr(torch.ops._C, op) for op in ("rms_norm", "silu_and_mul", "rotary_embedding"))
    return out


def requirements(requires: list[str]) -> dict:
    """vLLM's requirements against this Python: those the machine has at a version outside vLLM's
    range, and those it lacks that the kit does not carry (vLLM imports most of them lazily:
    attention backends, kernels for other GPUs, the server)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    from gpu_kit import CARRIED, norm

    env = {"extra": "", "platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux"}
    carried = {norm(n) for n in CARRIED} | {"vllm"}
    out: dict = {"outside_range": {}, "satisfied": 0, "carried": 0, "absent_not_carried": []}
    for line in requires:
        r = Requirement(line)
        if r.marker is not None and not r.marker.evaluate(env):
            continue
        try:
            have = md.version(r.name)
        except md.PackageNotFoundError:
            if norm(r.name) in carried:
                out["carried"] += 1
            else:
                out["absent_not_carried"].append(r.name)
            continue
        if r.specifier.contains(have, prereleases=True):
            out["satisfied"] += 1
        else:
            out["outside_range"][r.name] = {"have": have, "vllm_needs": str(r.specifier)}
    return out


def origins(modules=("torch", "transformers", "vllm", "google.protobuf")) -> dict:
    """Which file each module came from, and its version: the kit's folders ahead of the machine's."""
    out = {}
    for name in modules:
        try:
            m = importlib.import_module(name)
            out[name] = {"version": getattr(m, "__version__", None), "file": m.__file__}
        except Exception as e:  # noqa: BLE001 - reported
            out[name] = {"error": error(e)}
    return out


def nvidia_smi() -> dict:
    q = "name,driver_version,memory.total,compute_cap"
    p = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True,
                       timeout=30, check=True)
    return [dict(zip(q.split(","), (x.strip() for x in line.split(",")))) for line in p.stdout.strip().split("\n")]


def torch_probe() -> dict:
    import torch

    out = {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if out["cuda_available"]:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(512, 512, generator=g, dtype=torch.float64)
        got = (a.cuda().float() @ a.cuda().float()).double().cpu()
        out.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                   matmul_rel_err=float((got - a @ a).norm() / (a @ a).norm()))
    return out


def triton_probe() -> dict:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=m) + tl.load(y_ptr + i, mask=m), mask=m)

    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    t0 = time.perf_counter()
    add[(4,)](x, x, out, 1000, BLOCK=256)
    return {"version": triton.__version__, "kernel_ran": bool(torch.equal(out, 2 * x)),
            "compile_and_run_s": time.perf_counter() - t0}


def parts(kit: Path) -> dict:
    """Every part here against its own SHA256 file."""
    out = {}
    for sums in sorted(kit.glob("p*/SHA256")):
        ok = True
        for line in sums.read_text().split("\n"):
            if line.strip():
                digest, name = line.split(maxsplit=1)
                f = kit / name.strip()
                ok &= f.exists() and hashlib.sha256(f.read_bytes()).hexdigest() == digest
        out[sums.parent.name] = "ok" if ok else "damaged or incomplete"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kit", type=Path, default=Path(".gpu_kit"))
    ap.add_argument("--out", type=Path, default=Path("gpu_probe.json"))
    ap.add_argument("--lib-path", action="store_true", help="print the CUDA libraries' folders, ':'-joined")
    a = ap.parse_args()
    dirs = lib_dirs()
    if a.lib_path:
        print(":".join(dirs))
        return 0
    have = os.environ.get("LD_LIBRARY_PATH", "").split(":")
    if any(d not in have for d in dirs):  # the loader reads it at start: restart with it set
        os.environ["LD_LIBRARY_PATH"] = ":".join([*dirs, *[d for d in have if d]])
        os.execv(sys.executable, [sys.executable, *sys.argv])
    result: dict = {"lib_dirs": dirs}

    def needs() -> dict:  # what `make gpu-kit` read from vLLM's CUDA wheel (gpu_kit.stage)
        return json.loads(next(a.kit.glob("p*/probe/needs.json")).read_text())

    probes = {"parts": lambda: parts(a.kit), "gpu": nvidia_smi, "torch": torch_probe, "triton": triton_probe,
              "cuda_libraries": lambda: load_libs(CUDA_LIBS, dirs),
              "cumem_allocator": lambda: load_part(next(a.kit.glob("p*/probe/cumem_allocator.abi3.so"),
                                                        a.kit / "p1/probe/cumem_allocator.abi3.so"), None),
              "_C_stable_libtorch_symbols": lambda: resolve_symbols(needs()[VLLM_KERNELS[0]], dirs),
              "vllm_requirements": lambda: requirements(needs()["vllm_requires"]),
              "origins": lambda: origins(("torch", "triton", "transformers", "google.protobuf"))}
    for name, probe in probes.items():
        t0 = time.perf_counter()
        try:
            result[name] = probe()
        except Exception as e:  # noqa: BLE001 - each probe reports on its own
            result[name] = {"error": error(e)}
        print(f"{name} ({time.perf_counter() - t0:.1f} s): {json.dumps(result[name])}", flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
