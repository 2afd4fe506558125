#!/usr/bin/env bash
# launch_multinode.sh: run loadout on several nodes with torchrun's elastic agent. A thin wrapper: it only turns
# environment variables into torchrun flags and execs torchrun; rendezvous, restarts and fault handling are
# torchrun's (c10d rendezvous on MASTER_ADDR:MASTER_PORT). Run the same command on every node:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 ./scripts/launch_multinode.sh hardware=a100 data.root=/data/imagenet
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 ./scripts/launch_multinode.sh hardware=a100 data.root=/data/imagenet
#
# Arguments are Hydra overrides for `python -m train`. Environment (defaults in brackets):
#   NNODES [1]            nodes, or a range MIN:MAX for an elastic job
#   NPROC_PER_NODE [gpu]  processes per node (default: the GPUs nvidia-smi lists, else 1)
#   NODE_RANK             this node's rank (optional with c10d; give it for stable rank order)
#   MASTER_ADDR [localhost], MASTER_PORT [29500]   the rendezvous endpoint (any one node)
#   RDZV_ID [$SLURM_JOB_ID]  job id shared by all nodes (required on several nodes outside Slurm); it also names
#                         the run dir outputs/torchrun/$RDZV_ID, so a resubmitted job with the same id and
#                         trainer.resume=auto continues where it stopped
#   MAX_RESTARTS [3]      times torchrun restarts the whole group after a process dies
#   LOCAL_ADDR            this node's address on the network the job uses (torchrun --local-addr); default: what
#                         the hostname resolves to, which on a multi-homed node may be the wrong network
#   RDZV_CONF             extra rendezvous settings, e.g. "join_timeout=300,read_timeout=60" (torchrun --rdzv-conf)
#   GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME   the network interface the collectives use (docs/distributed.md)
#   TORCHRUN [torchrun]   the torchrun command (e.g. ".venv/bin/torchrun")
#
# torchrun's agent passes SIGTERM, SIGINT and (added here) SIGUSR1 on to the training processes, which stop at their
# next optimizer step with a checkpoint to resume from (docs/distributed.md, "Preemption").
set -euo pipefail

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); [[ "${gpus:-0}" -gt 0 ]]; then
    NPROC_PER_NODE=$gpus
  else
    NPROC_PER_NODE=1
  fi
fi

RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-}}
if [[ -z "$RDZV_ID" ]]; then
  if [[ "${NNODES:-1}" != 1 ]]; then
    echo "launch_multinode.sh: set RDZV_ID to a job id shared by all nodes (e.g. RDZV_ID=resnet50-run1)" >&2
    exit 2
  fi
  RDZV_ID="loadout-$(date +%Y%m%d-%H%M%S)-$$"
fi

# torchrun's shared TCPStore keeps a dead group's keys, so a restarted group fails to connect
# (pytorch/pytorch#135712); opting out gives every restart a fresh store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

args=(
  --nnodes="${NNODES:-1}"
  --nproc-per-node="$NPROC_PER_NODE"
  --rdzv-backend=c10d
  --rdzv-endpoint="${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}"
  --rdzv-id="$RDZV_ID"
  --max-restarts="${MAX_RESTARTS:-3}"
  --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
)
if [[ -n "${NODE_RANK:-}" ]]; then
  args+=(--node-rank="$NODE_RANK")
fi
if [[ -n "${LOCAL_ADDR:-}" ]]; then
  args+=(--local-addr="$LOCAL_ADDR")
fi
if [[ -n "${RDZV_CONF:-}" ]]; then
  args+=(--rdzv-conf="$RDZV_CONF")
fi

# `-m train`: the template of the checkout this script sits in, whatever folder it runs from (it is not installed)
PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH
# shellcheck disable=SC2086  # TORCHRUN may hold a command with arguments
exec ${TORCHRUN:-torchrun} "${args[@]}" -m train "$@"
