#!/usr/bin/env bash
# Issue 34's lease on one H200 (nvidia-h200): the 0.5B step beside TRL, the update's kernels (Liger against
# torch.compile), the 1.5B update, the 3B varlen and 7B sizing runs, each record with the estimate beside the
# measured peak, and tests/test_gpu.py. Calls of under 5 minutes, back to back (each within 30 s of the last, or
# the machine goes back and /tmp is lost), from the project's root, timeout_s 600; the helpers are
# bench/gpu_session.sh's. Stage first, here: SKIP_VERL=1 bash bench/stage_wheels.sh
#
#   call  carry                  command                          items
#   z1    .whl/vllm/c0 .whl/run  bash bench/sizes_session.sh z1   TRL + Liger install; model folders; TRL HF 0.5B
#   z2    .whl/vllm/c1           bash bench/sizes_session.sh z2   0.5B update: model code, torch.compile, Liger
#   z3    .whl/vllm/c2           bash bench/sizes_session.sh z3   1.5B update: model code, torch.compile
#   z4    .whl/vllm/c3           bash bench/sizes_session.sh z4   tests/test_gpu.py without vLLM; the 3B folder
#   z5    .whl/vllm/c4           bash bench/sizes_session.sh z5   the fused head's memory probe
#   z6    .whl/vllm/c5           bash bench/sizes_session.sh z6   vLLM install; rlkit 0.5B compiled + bare vLLM
#   z7    (nothing)              bash bench/sizes_session.sh z7   3B varlen, checkpointing, 65,536-token micro-batches
#   z8    (nothing)              bash bench/sizes_session.sh z8   7B full fine-tuning, checkpointing + CPU offload
#   z9    (nothing)              bash bench/sizes_session.sh z9   tests/test_gpu.py with vLLM
#   z10   (nothing)              bash bench/sizes_session.sh z10  3B varlen without checkpointing, 16,384-token ones
#
# Records: $OUT/<call>/<item>.json and $OUT/<call>.log; copy them to bench/results/<date>-h200/ as each returns.
set -uo pipefail
source "$(dirname "$0")/gpu_session.sh"

UPDATE=(python3 bench/update_levers.py --root "$MODELS" --warmup 1 --steps 8 --variants keep+fused)
VARLEN=(python3 bench/grpo_step.py --root "$MODELS" --shape 3b --engine vllm --lengths varlen --warmup 1 --steps 3)

models() {  # the random-weight model folders, filled on the GPU in a process of their own (the benches then
  # find them and never touch CUDA in the controller)
  item "models-$*" 60 python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench')
from workloads import build_model_dir
for shape in sys.argv[1:]: print(build_model_dir(shape, Path('$MODELS')))" "$@"
}

update() {  # update NAME SHAPE [settings]: the update alone, 1 + 8 rounds on the yardstick's batch
  item "$1" "$([ "$2" = 0.5b ] && echo 75 || echo 110)" "${UPDATE[@]}" --shape "$2" "${@:3}" --label "$1" \
    --json "$RAW/$1.json"
}

z1() {
  fetch vllm/c0
  install_run
  python3 -c "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' for p in ('liger-kernel', 'triton')))"
  models 0.5b 1.5b
  item trl-0.5b-hf 125 "${TRL[@]}" --shape 0.5b --label trl-hf --json "$RAW/trl-0.5b-hf.json"
}

z2() {
  fetch vllm/c1
  update update-0.5b-torch 0.5b
  update update-0.5b-liger 0.5b --set fsdp.kernels=liger
  update update-0.5b-compile 0.5b --set fsdp.compile=true
}

z3() {
  fetch vllm/c2
  update update-1.5b-torch 1.5b
  update update-1.5b-compile 1.5b --set fsdp.compile=true
}

z4() {
  fetch vllm/c3
  item gpu-tests 170 python3 -m pytest -q tests/test_gpu.py -rs --durations=0
  models 3b
}

z5() {
  fetch vllm/c4
  item head-memory 90 python3 bench/head_memory_probe.py --json "$RAW/head-memory.json"
}

z6() {  # with fsdp.compile=true, the faster update of z2 (2026-12-04); the bare engine sleeps between its calls
  fetch vllm/c5
  install_vllm || { echo "vLLM install failed"; return 1; }
  item rlkit-0.5b-vllm-compile 280 "${GRPO[@]}" --shape 0.5b --engine vllm --bare-vllm --breakdown-above 99 \
    --set fsdp.compile=true --label rlkit-vllm-compile --json "$RAW/rlkit-0.5b-vllm-compile.json"
}

z7() {
  item 3b-varlen-ac 200 "${VARLEN[@]}" --set fsdp.activation_checkpointing=true \
    --set max_tokens_per_micro_batch=65536 --label 3b-varlen-ac --json "$RAW/3b-varlen-ac.json"
}

z8() {  # the disk holds 64 GiB: the 1.5B and 3B folders go before the 7B one (30 GiB in fp32)
  rm -rf "$MODELS/qwen2-1.5b-random" "$MODELS/qwen2-3b-random"
  models 7b
  item 7b-ac-offload 220 python3 bench/grpo_step.py --root "$MODELS" --shape 7b --engine vllm --prompts 16 \
    --group 8 --warmup 1 --steps 2 --set fsdp.cpu_offload=true --set fsdp.activation_checkpointing=true \
    --label 7b-ac-offload --json "$RAW/7b-ac-offload.json"
}

z9() {
  item gpu-tests-vllm 170 python3 -m pytest -q tests/test_gpu.py -k vllm -rs --durations=0
}

z10() {
  rm -rf "$MODELS/qwen2-7b-random"
  models 3b
  item 3b-varlen-noac 200 "${VARLEN[@]}" --set max_tokens_per_micro_batch=16384 --label 3b-varlen-noac \
    --json "$RAW/3b-varlen-noac.json"
}

case "${1:-}" in
  z1|z2|z3|z4|z5|z6|z7|z8|z9|z10) run_call "$1" ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
