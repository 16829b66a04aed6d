#!/bin/bash
# Plain sbatch example: 2 nodes x 8 GPUs = 16 train.py processes, one per GPU, as one jax.distributed job.
#
#   sbatch scripts/sbatch_example.sh parallel=fsdp precision=bf16 train.steps=2000
#
# Nothing here names a coordinator or process id: train.py sees SLURM's environment (SLURM_JOB_ID,
# SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID) and distributed.enabled=null turns on
# jax.distributed with coordinator = first node of the step (port from the job id, or JAX_COORDINATOR_PORT),
# process id = SLURM_PROCID and one GPU per task (SLURM_LOCALID). Every task prints one line
# "distributed: coordinator=... process_id=... num_processes=... timeout_s=..." before it connects.
#
# Adapt the #SBATCH lines to your cluster (partition, account, time). The repository must be on a file system
# every node sees, with the same Python environment (same jax/jaxlib versions) on every node.
#SBATCH --job-name=dp-scaling
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8          # = GPUs per node: one process per GPU
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --partition=gpu
#SBATCH --output=slurm-%j.out        # all tasks; srun --label prefixes each line with its task id
#SBATCH --signal=TERM@120            # SIGTERM to every task 120 s before the time limit (below)

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"

# One run folder and one checkpoint folder for all tasks (orbax writes every process's shards into ONE folder).
RUN_DIR="${RUN_DIR:-outputs/slurm-${SLURM_JOB_ID}}"
export RUN_DIR
# Optional: a fixed coordinator port (default: derived from the job id by JAX).
# export JAX_COORDINATOR_PORT=12345

# Preemption, scancel and the time limit (--signal above) send SIGTERM to every task; srun passes it on and
# `exec` makes python the task itself. JAX's preemption service in each process catches it, the processes agree
# on one step, all save a checkpoint there and exit 1 with "stopped by SIGTERM (preemption, all processes)
# after step S of N; checkpoint saved in ...". SLURM kills what still runs KillWait seconds later (often 30 s).
# Resubmitting the same command continues from the checkpoint (RUN_DIR below is per job: to continue another
# job's run, set RUN_DIR to its folder, e.g. sbatch --export=ALL,RUN_DIR=outputs/slurm-<old job id> ...).
# --kill-on-bad-exit=1: a task that dies without saving ends the others instead of leaving them waiting.

# Task 0 writes .hydra/, train.log, summary.json, metrics.jsonl and W&B; task i > 0 only train_process<i>.log
# (hydra.output_subdir=null keeps it from rewriting .hydra/).
srun --label --kill-on-bad-exit=1 bash -c '
  extra=()
  if [ "${SLURM_PROCID}" != 0 ]; then extra+=(hydra.output_subdir=null); fi
  exec python train.py hydra.run.dir="${RUN_DIR}" checkpoint.dir="${RUN_DIR}/checkpoints" \
      distributed.timeout_s=600 "${extra[@]}" "$@"
' train "$@"
