#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with a CUDA GPU and a Python that has torch,
# transformers, sentencepiece, sacrebleu and safetensors (no set-up: it uses that Python as is).
#   bash scripts/gpu_check.sh [OUT_DIR] [MULTI30K_DIR] [MINUTES]
# 1. tests/test_cuda.py (GPU = CPU for forward and search; bf16 loss; bf16 training + resume);
# 2. benchmarks/speed.py --quick on the GPU, fp32 and bf16 (atencion vs Hugging Face);
# 3. the Multi30k En→De Tiny recipe on the GPU under bf16 for MINUTES (default 3) minutes;
# 4. configs/gpt2_124m.yaml for 30 updates (Tiny Shakespeare's token files): tokens/s and MFU, under
#    ddp on one GPU, and under fsdp on every GPU the machine has (torchrun).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu-check}
data=${2:-../shared/data/multi30k}
minutes=${3:-3}
mkdir -p "$out"
export PYTHONPATH="$PWD:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
python3 -m benchmarks.speed --quick --device cuda --json --data "$data" | tee "$out/speed_fp32.json"
python3 -m benchmarks.speed --quick --device cuda --bf16 --json --data "$data" | tee "$out/speed_bf16.json"
python3 -m benchmarks.multi30k --data "$data" --out "$out/m30k" --minutes "$minutes" \
    --set train.device=cuda --set train.bf16=true --set train.progress=false \
    --set train.tensorboard=false --set train.max_steps=100000 --set decode.beam=1 2> "$out/m30k.log" | tee "$out/m30k.json"
python3 -m benchmarks.gpt2_recipe --out "$out/gpt2" 2> "$out/gpt2.log" | tee "$out/gpt2.json"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -m torch.distributed.run --nproc-per-node "$gpus" -m benchmarks.gpt2_recipe --out "$out/gpt2-fsdp" \
    --set train.distributed=fsdp 2> "$out/gpt2-fsdp.log" | tee "$out/gpt2-fsdp.json"
