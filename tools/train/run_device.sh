#!/usr/bin/env bash
# Train the target, then the draft (distilled from the target), on one GPU; pack both
# checkpoints for the trip back.
#
#   bash tools/train/run_device.sh [DATA_DIR] [OUT_DIR]
#
# DATA_DIR (default .train_data) holds train.npy / heldout.npy / tokenizer files from
# tools/train/tokenizer.py. OUT_DIR (default $OUT, else ./out) receives run.log, the
# train_log.json files and models.tar split into <= 15 MB parts (models.tar.part-aa, -ab, ...):
#   cat OUT_DIR/models.tar.part-* | tar -xf - -C python/kdtree_native/data/default
#
# Environment:
#   TARGET_STEPS (2013) / DRAFT_STEPS (2500)  step counts of the shipped models; set one to
#       "auto" to size it from TARGET_BUDGET / DRAFT_BUDGET seconds instead (train.py --time-budget).
#   TEACHER   skip target training and distil the draft from this existing checkpoint dir
#             (how the shipped draft was made: TEACHER=<the shipped target>).
#   EXTRA_ARGS appended to every train.py call (CPU smoke test: "--steps 6 --batch 2 --ctx 64").
set -u
DATA=${1:-.train_data}
DEST=${2:-${OUT:-out}}
TARGET_STEPS=${TARGET_STEPS:-2013}
DRAFT_STEPS=${DRAFT_STEPS:-2500}
TARGET_BUDGET=${TARGET_BUDGET:-225}
DRAFT_BUDGET=${DRAFT_BUDGET:-110}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$DEST" /tmp/kn_models
cd "$(dirname "$0")/../.."
steps_arg() { if [ "$1" = auto ]; then echo "--time-budget $2"; else echo "--steps $1"; fi; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $PY -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.is_available())'
  if [ -z "${TEACHER:-}" ]; then
    $PY tools/train/train.py --which target --data "$DATA" --out /tmp/kn_models/target \
      $(steps_arg "$TARGET_STEPS" "$TARGET_BUDGET") ${EXTRA_ARGS:-}
    echo "target rc=$?"
    TEACHER=/tmp/kn_models/target
  fi
  $PY tools/train/train.py --which draft --data "$DATA" --out /tmp/kn_models/draft --teacher "$TEACHER" \
    $(steps_arg "$DRAFT_STEPS" "$DRAFT_BUDGET") ${EXTRA_ARGS:-}
  echo "draft rc=$?"
} 2>&1 | grep --line-buffered -v 'Writing model shards\|Loading weights' | tee "$DEST/run.log"
for w in draft target; do
  [ -f /tmp/kn_models/$w/train_log.json ] && cp /tmp/kn_models/$w/train_log.json "$DEST/${w}_train_log.json"
done
(cd /tmp/kn_models && tar -cf - $(ls -d target draft 2>/dev/null)) | split -b 15M - "$DEST/models.tar.part-"
ls -la "$DEST"
