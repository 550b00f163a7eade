#!/usr/bin/env bash
# The whole pipeline on Slurm: generate (array) -> distill (multi-node) -> validate -> export,
# chained with --dependency=afterok and handing off by path, in the same RUN_DIR layout as
# `specdistill` (so `python -m specdistill.distill.pipeline.report RUN_DIR` reads either). The base
# drafter is validated in parallel; a last small job writes RUN_DIR/summary.md and report.png.
#
#   slurm/pipeline.sh RUN_DIR [OVERRIDE ...]
#   slurm/pipeline.sh /runs/llama pair=llama3 generate.dataset=ultrachat distill.loss=tvd distill.deepspeed=zero3
#
# OVERRIDE: `STAGE.key=value` goes to that stage (generate, distill, validate, export) as
# `key=value`; anything else (the pair) goes to every stage. Cluster settings come from the
# environment or a config file (slurm/settings.sh); a missing one stops here, before sbatch.
# Prints the job ids, one `stage=id` per line.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=slurm/settings.sh
source "$here/settings.sh"

if [[ $# -lt 1 || "$1" == *=* ]]; then
  echo "error: RUN_DIR is missing: slurm/pipeline.sh RUN_DIR [OVERRIDE ...]" >&2
  exit 2
fi
run="$(mkdir -p "$1" && cd "$1" && pwd)"
shift
sd_load_settings || exit 2
sd_common_sbatch_args

common=() generate=() distill=() validate=() export_=()
for arg in "$@"; do
  case "$arg" in
    generate.*) generate+=("${arg#generate.}") ;;
    distill.*) distill+=("${arg#distill.}") ;;
    validate.*) validate+=("${arg#validate.}") ;;
    export.*) export_+=("${arg#export.}") ;;
    *) common+=("$arg") ;;
  esac
done

gpus="$SPECDISTILL_GPUS_PER_NODE"
tasks="${SPECDISTILL_GENERATE_TASKS:-1}"
nodes="${SPECDISTILL_NODES:-1}"
best="$run/distill/best"

gen=$(sbatch "${SD_COMMON[@]}" --array="0-$((tasks - 1))" --gpus-per-task=1 \
  "$here/generate_array.sbatch" "${common[@]}" "output_dir=$run/generate" "${generate[@]}")
dist=$(sbatch "${SD_COMMON[@]}" --dependency="afterok:$gen" --nodes="$nodes" \
  --ntasks-per-node=1 --gpus-per-node="$gpus" \
  "$here/distill.sbatch" "${common[@]}" "output_dir=$run/distill" "data.path=$run/generate" \
  "${distill[@]}")
base=$(sbatch "${SD_COMMON[@]}" --gpus=1 \
  "$here/validate.sbatch" "${common[@]}" "output_dir=$run/validate_base" "${validate[@]}")
val=$(sbatch "${SD_COMMON[@]}" --dependency="afterok:$dist" --gpus=1 \
  "$here/validate.sbatch" "${common[@]}" "pair.drafter=$best" "output_dir=$run/validate" \
  "${validate[@]}")
exp=$(sbatch "${SD_COMMON[@]}" --dependency="afterok:$val" --gpus=1 \
  "$here/export.sbatch" "${common[@]}" "drafter=$best" "report=$run/validate/report.json" \
  "output_dir=$run/export/drafter" "overwrite=true" "${export_[@]}")
rep=$(sbatch "${SD_COMMON[@]}" --dependency="afterok:$base:$exp" --job-name=specdistill-report \
  --wrap="${SPECDISTILL_SETUP:+$SPECDISTILL_SETUP; }python -m specdistill.distill.pipeline.report '$run'")

printf 'generate=%s\ndistill=%s\nvalidate_base=%s\nvalidate=%s\nexport=%s\nreport=%s\n' \
  "$gen" "$dist" "$base" "$val" "$exp" "$rep"
echo "exported drafter (when the chain finishes): $run/export/drafter" >&2
