#!/usr/bin/env bash
# The GPU kit's second call on the lent machine (docs/gpu.md), from the repository's root, once
# every part of `make gpu-kit` (scripts/gpu_carry.sh) is there: checks the parts, unpacks the kit's
# two site folders into /tmp/kit, puts the CUDA libraries' folders on LD_LIBRARY_PATH and runs
# scripts/gpu_vllm_check.py, its JSON (rewritten after every check) and log into $OUT (./ without).
# The call's clock starts here: no check starts after CALL_BUDGET_S (300) and the check stops itself
# at CALL_STOP_S (350), keeping what ran; the call's timeout_s (420) is the margin above that.
#   bash scripts/gpu_kit_run.sh          # set-up, then the check
#   bash scripts/gpu_kit_run.sh setup    # set-up only, then:
#     export PYTHONPATH=/tmp/kit/over:/tmp/kit/base:$PWD LD_LIBRARY_PATH=$(python3 scripts/gpu_probe.py --lib-path)
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.gpu_kit
OUTDIR=${OUT:-.}
manifest=$(find "$KIT" -name MANIFEST.sha256 2>/dev/null | head -1)
if [ -z "$manifest" ] || ! (cd "$KIT" && sha256sum -c --quiet "${manifest#"$KIT"/}"); then
  echo "gpu kit: a part is missing or damaged (each call carrying one part, right after the other?)" >&2; exit 2
fi
rm -rf /tmp/kit && mkdir -p /tmp/kit
# the chunks in split's order (their suffix), whatever their parts' names
find "$KIT" -name 'kit.tar.xz.*' -printf '%f %p\n' | sort | cut -d' ' -f2 | xargs cat | xz -d -T0 | tar xf - -C /tmp/kit
export PYTHONPATH=/tmp/kit/over:/tmp/kit/base:$PWD
LIBS=$(python3 scripts/gpu_probe.py --lib-path)
export LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "gpu kit: set up in $SECONDS s"
if [ "${1:-check}" = setup ]; then
  python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name(0))"
  exit 0
fi
BACKEND=()
# without FlashAttention's kernels the check runs vLLM's Triton attention
[ -f /tmp/kit/base/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so ] || BACKEND=(--set generation.attention_backend=TRITON_ATTN)
PYTHONUNBUFFERED=1 python3 scripts/gpu_vllm_check.py --out "$OUTDIR/gpu_vllm_check.json" \
  --budget-s $(( ${CALL_BUDGET_S:-300} - SECONDS )) --stop-s $(( ${CALL_STOP_S:-350} - SECONDS )) "${BACKEND[@]}" \
  2>&1 | tee "$OUTDIR/gpu_vllm_check.log"
