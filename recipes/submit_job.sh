#!/usr/bin/env bash
# Submit the toy PPO recipe to a running Ray cluster as a Ray job, and wait for it to end.
#
#   recipes/submit_job.sh [hydra overrides...]
#   RAY_ADDRESS=http://head:8265 recipes/submit_job.sh trainer.total_steps=60 \
#       checkpoint.root_dir=/shared/ckpt/ppo_toy
#
# RAY_ADDRESS   the cluster's job server (dashboard) address; default http://127.0.0.1:8265.
# RAY_JOB_STOP_WAIT_TIME_S  seconds `ray job stop` waits after its SIGTERM before it SIGKILLs
#               the driver (Ray's default is 3; default here 90). Keep it above
#               checkpoint.preemption.grace_s (60): the driver saves and commits the step under
#               way, then exits with status 75. Ray's job supervisor reads it from the job's
#               runtime environment, so it is set per job.
# RUNTIME_ENV_JSON  replaces the runtime environment below.
# The repository (this script's parent directory) is uploaded as the job's working directory;
# the cluster's Python must already have the dependencies (pip install -e . there, or a
# runtime_env with pip). Give checkpoint.root_dir as an absolute path on a filesystem every
# node shares: a relative one would land in the job's temporary copy of the repository.
set -euo pipefail

cd "$(dirname "$0")/.."
address="${RAY_ADDRESS:-http://127.0.0.1:8265}"
stop_wait_s="${RAY_JOB_STOP_WAIT_TIME_S:-90}"
if ! [[ "$stop_wait_s" =~ ^[0-9]+$ ]]; then
    echo "submit_job.sh: RAY_JOB_STOP_WAIT_TIME_S=$stop_wait_s must be a whole number of seconds" >&2
    exit 2
fi
# One torch/OpenMP thread per rank; the working directory needs no .git.
default_env="{\"env_vars\": {\"OMP_NUM_THREADS\": \"1\", \"RAY_JOB_STOP_WAIT_TIME_S\": \"$stop_wait_s\"}, \"excludes\": [\".git\"]}"
runtime_env="${RUNTIME_ENV_JSON:-$default_env}"

# Ray enables token authentication on clusters started where a token exists
# (~/.ray/auth_token), but its CLI only sends the token in RAY_AUTH_MODE=token.
if [[ -z "${RAY_AUTH_MODE:-}" ]] &&
    [[ -n "${RAY_AUTH_TOKEN:-}" || -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]]; then
    export RAY_AUTH_MODE=token
fi

exec ray job submit --address "$address" --working-dir . --runtime-env-json "$runtime_env" \
    -- python -m recipes.ppo_toy "$@"
