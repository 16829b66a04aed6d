#!/bin/bash
# Plain sbatch: one train.py process per task, all tasks of the job one jax.distributed job (docs/cluster.md).
#
#   sbatch scripts/sbatch_example.sh data=synthetic train.steps=2000                     # CPU nodes: 2 x 1 task
#   sbatch --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8 \
#       scripts/sbatch_example.sh parallel=fsdp precision=bf16                            # GPU nodes: one task per GPU
#
# Options on sbatch's command line override the #SBATCH lines below (partition, account, time, nodes).
# Nothing here names a coordinator or process id: train.py sees SLURM's environment (SLURM_JOB_ID,
# SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID) and distributed.enabled=null turns on
# jax.distributed with coordinator = first node of the step (port from the job id, or JAX_COORDINATOR_PORT),
# process id = SLURM_PROCID and one GPU per task (SLURM_LOCALID). The repository must be on a file system every
# node sees, with the same Python environment (same jax/jaxlib versions) on every node.
#SBATCH --job-name=dp-scaling
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=01:00:00
#SBATCH --output=slurm-%j.out        # all tasks; srun --label prefixes each line with its task id
#SBATCH --open-mode=append           # a requeued job adds to its output instead of replacing it
#SBATCH --signal=TERM@120            # SIGTERM to every task 120 s before the time limit (below)
#SBATCH --requeue                    # preemption (PreemptMode=REQUEUE) or scontrol requeue: start again, same job id

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"

# One run folder and one checkpoint folder for all tasks (orbax writes every process's shards into ONE folder).
# Per job id, so a requeued job (same id) continues from its own checkpoint.
RUN_DIR="${RUN_DIR:-outputs/slurm-${SLURM_JOB_ID}}"
export RUN_DIR

# Preemption, scancel and the time limit (--signal above) send SIGTERM to every task; `exec` makes python the
# task itself. The processes agree on one step, all save a checkpoint there and exit 1; process 0 prints
# "error: stopped by SIGTERM (preemption, all processes) after step S of N; checkpoint saved in ...; continue
# with the same command and checkpoint.dir=...". Resubmitting so continues from that checkpoint; a job SLURM
# requeues continues by itself. A task that dies (kill -9, out of memory) stops the others at once: process 0
# (or the lowest survivor) prints one line naming its task and node, and summary.json says failed.
# --wait=30: a task that dies before the processes watch each other ends the others 30 s later. Not
# --kill-on-bad-exit: srun would end the step the moment a task dies, and the survivor's line could be lost.

# Task 0 writes .hydra/, train.log, summary.json, metrics.jsonl and W&B; task i > 0 only train_process<i>.log
# (hydra.output_subdir=null keeps it from rewriting .hydra/).
srun --label --kill-on-bad-exit=0 --wait=30 bash -c '
  extra=()
  if [ "${SLURM_PROCID}" != 0 ]; then extra+=(hydra.output_subdir=null); fi
  exec python train.py hydra.run.dir="${RUN_DIR}" checkpoint.dir="${RUN_DIR}/checkpoints" \
      distributed.timeout_s=600 "${extra[@]}" "$@"
' train "$@"
