#!/usr/bin/env bash
# Time to accuracy of the block algorithms at several block lengths, with exact SGD as the
# reference (issue 19): the evidence for Auto's block-length rule (bunsan/algorithms/auto.py).
# Per model the block algorithm Auto would take under the campaign's optimizer (block momentum
# for the digits CNN and the 10.5M MLP, SGD without momentum; model averaging for MNIST-1D,
# momentum 0.9), at block sizes of 8 to 128 steps (the MLP: 16 to 256) at 2 and 4 workers; the training
# settings are those of docs/experiments/tta_campaign.sh.
# Usage: docs/experiments/block_sweep.sh OUT_DIR [NETWORKS] [MODELS]; SEEDS as in tta_campaign.sh;
# NP (environment): the worker counts, default "2,4" (the block lengths in steps above are per count)
set -euo pipefail
out=${1:?usage: block_sweep.sh OUT_DIR [NETWORKS] [MODELS]}
networks=${2:-"loopback rate=100mbit"}
models=${3:-"digits_cnn mnist1d_cnn"}
bunsan=${BUNSAN:-bunsan}
seeds=${SEEDS:-0}
np=${NP:-2,4}
for net in $networks; do
  shaping=()
  [ "$net" != loopback ] && shaping=(--network "$net")
  for model in $models; do
    case $model in
      # per-worker batch 32 at 2 workers, 16 at 4: 256..2048 are 8..64 and 16..128 steps
      digits_cnn)  args=(--model digits_cnn --dataset digits -np "$np" --epochs 30 --batch 64 --lr 0.1 --momentum 0)
                   algos=(data_parallel block_momentum:block_size=256 block_momentum:block_size=512
                          block_momentum:block_size=1024 block_momentum:block_size=2048) ;;
      # per-worker batch 64 at 2 workers, 32 at 4: 512..4096 are 8..64 and 16..128 steps
      mnist1d_cnn) args=(--model mnist1d_cnn --dataset mnist1d -np "$np" --epochs 40 --batch 128 --lr 0.05 --momentum 0.9)
                   algos=(data_parallel model_averaging:block_size=512 model_averaging:block_size=1024
                          model_averaging:block_size=2048 model_averaging:block_size=4096) ;;
      # per-worker batch 32 at 2 workers, 16 at 4: 512..4096 are 16..128 and 32..256 steps. Epochs to
      # target do not depend on the link: a loopback sweep gives them; the exchange's cost at 100 Mbit/s
      # (3.4 s a block at 2 workers, 5-8 s at 4) then says which length is fastest there
      mlp_10m)     args=(--model mlp_10m --dataset digits32_gray -np "$np" --epochs 20 --batch 64 --lr 0.1 --momentum 0)
                   algos=(data_parallel "block_momentum:block_size=512,block_learning_rate=0.5"
                          "block_momentum:block_size=1024,block_learning_rate=0.5"
                          "block_momentum:block_size=2048,block_learning_rate=0.5"
                          "block_momentum:block_size=4096,block_learning_rate=0.5") ;;
      # the same MLP under model averaging, the other block algorithm, at 32 and 64 steps a block at
      # 4 workers (NP=4): which of the two the tie rule should take at momentum 0 on this model
      mlp_10m_ma)  args=(--model mlp_10m --dataset digits32_gray -np "$np" --epochs 20 --batch 64 --lr 0.1 --momentum 0)
                   algos=(data_parallel model_averaging:block_size=512 model_averaging:block_size=1024) ;;
      # block momentum at its defaults (block_learning_rate 1, as Auto builds it; the campaign's fixed
      # settings and the mlp_10m sweep above take 0.5) at 32 and 64 steps a block at 4 workers
      mlp_10m_bm1) args=(--model mlp_10m --dataset digits32_gray -np "$np" --epochs 20 --batch 64 --lr 0.1 --momentum 0)
                   algos=(data_parallel block_momentum:block_size=512 block_momentum:block_size=1024) ;;
      # the digits CNN under model averaging: 16 / 32 / 64 steps at 2 workers, 32 / 64 / 128 at 4
      digits_cnn_ma) args=(--model digits_cnn --dataset digits -np "$np" --epochs 30 --batch 64 --lr 0.1 --momentum 0)
                   algos=(data_parallel model_averaging:block_size=512 model_averaging:block_size=1024
                          model_averaging:block_size=2048) ;;
      *) echo "unknown model $model" >&2; exit 2 ;;
    esac
    for seed in $seeds; do
      dir="$out/${model}-${net//=/_}"
      [ "$seed" != 0 ] && dir="$dir-s$seed"
      $bunsan bench compare "${args[@]}" --seed "$seed" "${shaping[@]}" --algorithms "${algos[@]}" \
        --no-plots --out "$dir"
      $bunsan bench tta "$dir/compare.json" | tee "$dir/tta.txt"
    done
  done
done
