#!/usr/bin/env bash
# `make gpu-kit`: packs what the lent GPU machine lacks for vLLM's engine check into parts that each
# travel in one call beside the working tree (a call carries at most 64 MiB, the tree included), and
# prints the calls (docs/gpu.md). scripts/gpu_kit.py names what travels and into which of its two
# site folders; the parts are one xz stream of both, cut to fit:
#   call 1 carries p1 (and p1/probe: the sleep-mode allocator, what vLLM's compiled parts need from
#          the machine) and runs scripts/gpu_probe.py: machine, PyTorch, Triton, CUDA libraries;
#   call 2 carries p2 and runs scripts/gpu_kit_run.sh: both parts checked, unpacked, the check run.
# WITH_FA3=1 adds FlashAttention 3 (43 MiB compressed: one more part, one more call).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu_kit
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
EXCLUDE=$(git rev-parse --git-path info/exclude)
grep -qx '/.gpu_kit/' "$EXCLUDE" 2>/dev/null || { mkdir -p "$(dirname "$EXCLUDE")"; echo '/.gpu_kit/' >> "$EXCLUDE"; }
rm -rf "$OUT"

FA3=()
[ "${WITH_FA3:-0}" = 1 ] && FA3=(--fa3)
.venv/bin/python scripts/gpu_kit.py stage "$WORK/kit" "${FA3[@]}"

# what travels with every call: tracked files, untracked ones git does not ignore, and shared/
TREE=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
[ -d shared ] && TREE=$((TREE + $(du -sb shared | cut -f1)))
PROBE=$(du -sb "$WORK/kit/probe" | cut -f1)
# 2 MiB of the call left for the tree to grow between this build and the calls
PART=$(( (64 << 20) - TREE - PROBE - (2 << 20) ))
tar cf - -C "$WORK/kit" over base | xz -9 -T2 > "$WORK/kit.tar.xz"
# as few parts as fit, of equal size (the most room left in each call)
TOTAL=$(stat -c %s "$WORK/kit.tar.xz")
n=$(( (TOTAL + PART - 1) / PART ))
split -b $(( (TOTAL + n - 1) / n )) -d -a 2 "$WORK/kit.tar.xz" "$WORK/kit.tar.xz."
i=0
for chunk in "$WORK"/kit.tar.xz.[0-9][0-9]; do
  i=$((i + 1)); mkdir -p "$OUT/p$i"; mv "$chunk" "$OUT/p$i/"
done
mv "$WORK/kit/probe" "$OUT/p1/probe"
for i in $(seq 1 "$n"); do (cd "$OUT" && find "p$i" -type f | sort | xargs sha256sum > "$WORK/SHA256" && mv "$WORK/SHA256" "p$i/"); done
cat "$OUT"/p*/SHA256 > "$OUT/p$n/MANIFEST.sha256"

mib() { awk '{printf "%.1f", $1 / 1048576}' <<< "$1"; }
echo "GPU kit: $n parts (the working tree is $(mib "$TREE") MiB of a call's 64):"
for p in "$OUT"/p*; do echo "  $p  $(mib "$(du -sb "$p" | cut -f1)") MiB, with the tree $(mib $(( $(du -sb "$p" | cut -f1) + TREE ))) MiB"; done
echo "Calls, one right after the other (the machine keeps earlier parts only while it stays warm, ~30 s):"
echo "  run  carry=[\".gpu_kit/p1\"]  timeout_s=120  command: python3 scripts/gpu_probe.py --out \$OUT/gpu_probe.json"
for i in $(seq 2 $((n - 1))); do echo "  run  carry=[\".gpu_kit/p$i\"]  timeout_s=60  command: cd .gpu_kit && sha256sum -c p$i/SHA256"; done
echo "  run  carry=[\".gpu_kit/p$n\"]  timeout_s=420  command: bash scripts/gpu_kit_run.sh"
echo "  give_back"
[ "$n" -le 2 ] || echo "WARNING: $n parts: more than the two calls docs/gpu.md plans for" >&2
