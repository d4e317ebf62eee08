#!/usr/bin/env bash
# Multi-node launch of examples/pretrain_vlm_packed.py with torchrun.
#
# Plain torchrun (run on every node, same MASTER_ADDR/PORT, NODE_RANK 0..NNODES-1):
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 bash examples/launch_multinode.sh
#
# SLURM (one task per node; srun sets the rank variables):
#   #SBATCH --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --exclusive
#   export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
#   srun --kill-on-bad-exit=1 env NNODES=$SLURM_NNODES NODE_RANK=$SLURM_NODEID bash examples/launch_multinode.sh
#
# Notes:
# - TP*CP*PP must divide the GPUs per node * nodes; keep TP (and CP when you can) inside a node.
# - --sequence-parallel needs TP > 1; packing aligns every pack for it (T is a multiple of cp*tp).
# - CP > 1 needs Transformer Engine on GPU (or our reference attention on CPU for tests).
# - --micro-batch-size counts samples per micro-batch before packing; each becomes one THD pack.
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
TP=${TP:-2}; CP=${CP:-2}; PP=${PP:-1}

export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron's TP/SP comm-compute overlap expects it

torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  "$(dirname "$0")/pretrain_vlm_packed.py" --dataloader-type external \
  --tensor-model-parallel-size "$TP" --context-parallel-size "$CP" --pipeline-model-parallel-size "$PP" \
  --sequence-parallel --bf16 \
  --num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 \
  --seq-length 8192 --max-position-embeddings 8192 \
  --micro-batch-size 4 --global-batch-size 256 --train-iters 1000 \
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
  --tokenizer-type NullTokenizer --vocab-size 256 \
  --transformer-impl transformer_engine --position-embedding-type rope \
  --calculate-per-token-loss --eval-iters 0 --eval-interval 1000 --no-gradient-accumulation-fusion \
  --log-interval 10 "$@"
