#!/usr/bin/env bash
# Train the tiny model family shipped in data/tiny/ from ShareGPT token files.
#   data/tiny/train.sh DATA OUT STAGE [SECONDS] [--smoke]
# STAGE, in this order:
#   targets   the Qwen3 and Qwen3-Next targets (SECONDS each) and the STANDALONE draft model (SECONDS / 3)
#   distill   the Qwen3 target's greedy replies to train prompts (OUT/qwen3-distill.npz), SECONDS
#   drafters  eagle3 + dflash + mtp, SECONDS each (or one of them as its own stage): EAGLE3 and DFlash
#             learn from the distilled replies when they exist, the MTP layer from ShareGPT
# Each stage fits its schedule into its time budget (compilation included).
# --smoke: a few tiny steps per stage, to check the recipe on a CPU.
# DATA holds tokenizer/, train.npz and heldout.npz, made on any machine with
#   jspec train tokenizer --out DATA/tokenizer
#   jspec train corpus --tokenizer DATA/tokenizer --out DATA/train.npz
#   jspec train corpus --tokenizer DATA/tokenizer --split heldout --out DATA/heldout.npz
set -euo pipefail
DATA=$1; OUT=$2; STAGE=$3; T=${4:-150}
JSPEC=${JSPEC:-"python -m jspec.cli"}
SIZE="--steps 100000 --batch-size 64 --seq-len 512"
if [[ "${5:-}" == "--smoke" ]]; then
  SIZE="--steps 3 --batch-size 2 --seq-len 64 --eval-windows 2 --eval-every 3 --log-every 1"
fi
case $STAGE in
  targets)
    common="--tokenizer $DATA/tokenizer --corpus $DATA/train.npz --heldout $DATA/heldout.npz $SIZE"
    $JSPEC train target --config qwen3 $common --out $OUT/qwen3 --time-budget $T
    $JSPEC train target --config qwen3-next $common --out $OUT/qwen3-next --time-budget $T
    $JSPEC train target --config qwen3-draft $common --out $OUT/qwen3-draft --time-budget $((T / 3)) ;;
  distill)
    extra=""
    [[ "${5:-}" == "--smoke" ]] && extra="--max-prompts 8 --max-new-tokens 16 --max-running-requests 8 --dtype float32"
    $JSPEC train distill --target $OUT/qwen3 --corpus $DATA/train.npz --out $OUT/qwen3-distill.npz \
      --max-prompt-tokens 512 --time-budget $T $extra ;;
  drafters|eagle3|dflash|mtp)
    common="--heldout $DATA/heldout.npz --time-budget $T $SIZE"
    [[ "${5:-}" == "--smoke" ]] && common="$common --eval-batch-size 2"
    replies=$DATA/train.npz
    [[ -f $OUT/qwen3-distill.npz ]] && replies=$OUT/qwen3-distill.npz
    if [[ $STAGE == drafters || $STAGE == eagle3 ]]; then
      $JSPEC train eagle3 --target $OUT/qwen3 --out $OUT/qwen3-eagle3 --ttt-steps 3 --corpus $replies $common
    fi
    if [[ $STAGE == drafters || $STAGE == dflash ]]; then
      $JSPEC train dflash --target $OUT/qwen3 --out $OUT/qwen3-dflash --block-size 8 --num-layers 3 \
        --corpus $replies $common
    fi
    if [[ $STAGE == drafters || $STAGE == mtp ]]; then
      $JSPEC train mtp --target $OUT/qwen3-next --in-place --ttt-steps 3 --corpus $DATA/train.npz $common
    fi ;;
  *) echo "STAGE must be targets, distill, drafters, eagle3, dflash or mtp" >&2; exit 2 ;;
esac
