# Cluster settings for specdistill's Slurm scripts, from the environment or a config file.
# Sourced by slurm/pipeline.sh; nothing cluster-specific is hard-coded in the sbatch scripts.
#
# File: $SPECDISTILL_SLURM_CONFIG (default ~/.config/specdistill/slurm.env), KEY=VALUE lines
# in shell syntax; a variable already set in the environment wins over the file.
#   required: SPECDISTILL_PARTITION  SPECDISTILL_TIME (e.g. 12:00:00)  SPECDISTILL_GPUS_PER_NODE
#   optional: SPECDISTILL_ACCOUNT  SPECDISTILL_NODES (distill nodes, 1)
#             SPECDISTILL_GENERATE_TASKS (generate array size, 1)  SPECDISTILL_CPUS_PER_TASK
#             SPECDISTILL_SETUP (shell run first in every job: module load ..., source venv,
#             or a container wrapper)  SPECDISTILL_SBATCH_ARGS / SPECDISTILL_SRUN_ARGS (extra
#             flags, e.g. --qos=... or --container-image=...)  SPECDISTILL_MASTER_PORT
SPECDISTILL_REQUIRED=(SPECDISTILL_PARTITION SPECDISTILL_TIME SPECDISTILL_GPUS_PER_NODE)
SPECDISTILL_OPTIONAL=(SPECDISTILL_ACCOUNT SPECDISTILL_NODES SPECDISTILL_GENERATE_TASKS
  SPECDISTILL_CPUS_PER_TASK SPECDISTILL_SETUP SPECDISTILL_SBATCH_ARGS SPECDISTILL_SRUN_ARGS
  SPECDISTILL_MASTER_PORT)

sd_load_settings() {
  local config="${SPECDISTILL_SLURM_CONFIG:-$HOME/.config/specdistill/slurm.env}" var
  if [[ -n "${SPECDISTILL_SLURM_CONFIG:-}" && ! -f "$config" ]]; then
    echo "error: SPECDISTILL_SLURM_CONFIG=$config does not exist" >&2
    return 2
  fi
  if [[ -f "$config" ]]; then
    local -A from_env=()
    for var in "${SPECDISTILL_REQUIRED[@]}" "${SPECDISTILL_OPTIONAL[@]}"; do
      [[ -n "${!var+x}" ]] && from_env[$var]="${!var}"
    done
    # shellcheck disable=SC1090
    source "$config"
    for var in "${!from_env[@]}"; do printf -v "$var" '%s' "${from_env[$var]}"; done
  fi
  for var in "${SPECDISTILL_REQUIRED[@]}"; do
    if [[ -z "${!var:-}" ]]; then
      echo "error: $var is not set: export it or add it to $config (see slurm/settings.sh)" >&2
      return 2
    fi
  done
  for var in "${SPECDISTILL_REQUIRED[@]}" "${SPECDISTILL_OPTIONAL[@]}"; do
    [[ -n "${!var+x}" ]] && export "${var?}"
  done
  return 0
}

# The sbatch flags every job gets: partition, time, account (if any), extra flags.
sd_common_sbatch_args() {
  SD_COMMON=(--parsable --partition="$SPECDISTILL_PARTITION" --time="$SPECDISTILL_TIME")
  [[ -n "${SPECDISTILL_ACCOUNT:-}" ]] && SD_COMMON+=(--account="$SPECDISTILL_ACCOUNT")
  [[ -n "${SPECDISTILL_CPUS_PER_TASK:-}" ]] && SD_COMMON+=(--cpus-per-task="$SPECDISTILL_CPUS_PER_TASK")
  # shellcheck disable=SC2206
  [[ -n "${SPECDISTILL_SBATCH_ARGS:-}" ]] && SD_COMMON+=(${SPECDISTILL_SBATCH_ARGS})
  return 0
}
