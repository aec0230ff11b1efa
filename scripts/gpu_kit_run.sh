#!/usr/bin/env bash
# On the GPU machine, in the repository's root, after every part of `make gpu-kit` arrived
# (scripts/gpu_carry.sh): checks the parts against the manifest, unpacks the kit into /tmp/site, and
# runs scripts/gpu_vllm_check.py (its JSON into $OUT when the device tool sets it, else ./).
#   bash .gpu_kit/pN/run.sh            # setup, then the check
#   bash .gpu_kit/pN/run.sh setup      # setup only; then: export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
KIT=.gpu_kit
manifest=$(find "$KIT" -name MANIFEST.sha256 | head -1)   # in the last part
(cd "$KIT" && sha256sum -c --quiet "${manifest#"$KIT"/}") || {
  echo "gpu kit: a part is missing or damaged (sent in order, each call naming one part?)" >&2; exit 2; }
rm -rf /tmp/kit /tmp/site && mkdir -p /tmp/kit /tmp/site
# the chunks in split's order (their suffix), whatever their parts' names
find "$KIT" -name 'kit.tar.xz.*' -printf '%f %p\n' | sort | cut -d' ' -f2 | xargs cat | xz -d | tar xf - -C /tmp/kit
tar xf /tmp/kit/site.tar -C /tmp/site
tar xf /tmp/kit/vllm_py.tar -C /tmp/site
tar xf /tmp/kit/kernels.tar -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/kit/whl/*.whl
if [ ! -f /tmp/site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so ]; then
  # no FlashAttention kernels carried: let its package import without them (Triton attention runs)
  sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:  # kernels not carried/' \
    /tmp/site/vllm/vllm_flash_attn/__init__.py
  BACKEND=(--set generation.attention_backend=TRITON_ATTN)
else
  BACKEND=()
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name(0))"
[ "${1:-check}" = setup ] && exit 0
PYTHONUNBUFFERED=1 python3 scripts/gpu_vllm_check.py --out "${OUT:-.}/gpu_vllm_check.json" "${BACKEND[@]}" \
  2>&1 | tee "${OUT:-.}/gpu_vllm_check.log"
