#!/usr/bin/env bash
# Issue 31's lease on one H200 (nvidia-h200): LoRA on the GPU's dtypes, every run of the issue in calls of under
# 5 minutes, each writing its records under $OUT as its items finish (the helpers are bench/gpu_session.sh's).
# Stage first, here: bash bench/stage_wheels.sh (SKIP_VERL is not needed: verl is not carried). Then the calls,
# back to back (each within 30 s of the last, or the machine goes back and /tmp is lost), from the project's
# root, timeout_s 600:
#
#   call  carry          command                          items
#   l1    .whl/vllm/c0   bash bench/lora_session.sh l1    0.5B LoRA r16, hf engine: FSDP2/FSDP1 x merged/adapter sync
#   l2    .whl/vllm/c1   bash bench/lora_session.sh l2    0.5B LoRA with CPU offload + checkpointing; GPU tests (no vLLM)
#   l3    .whl/vllm/c2   bash bench/lora_session.sh l3    the 7B model folder (random weights)
#   l4    .whl/vllm/c3   bash bench/lora_session.sh l4    (carrying)
#   l5    .whl/vllm/c4   bash bench/lora_session.sh l5    (carrying)
#   l6    .whl/vllm/c5   bash bench/lora_session.sh l6    vLLM install; 0.5B LoRA r16 on vLLM, merged and adapter sync
#   l7    (nothing)      SYNC=adapter bash bench/lora_session.sh l7   7B LoRA r16 with KL on vLLM, the faster sync
#   l8    (nothing)      bash bench/lora_session.sh l8    GPU tests with vLLM; 0.5B FSDP1 on vLLM
#
# Records: $OUT/<call>/<item>.json and $OUT/<call>.log; copy them to bench/results/<date>-h200/ as each returns.
set -uo pipefail
source "$(dirname "$0")/gpu_session.sh"

LORA=(--set lora.rank=16 --set lora.alpha=32 --beta 0.01)
SMALL=(python3 bench/grpo_step.py --root "$MODELS" --shape 0.5b --prompts 8 --group 4 --response-len 32
       --warmup 2 --steps 8 "${LORA[@]}")
YARDSTICK=(python3 bench/grpo_step.py --root "$MODELS" --shape 0.5b --engine vllm --warmup 2 --steps 8 "${LORA[@]}")

hf_run() {  # hf_run FSDP_VERSION SYNC [more settings]: the small 0.5B LoRA workload on the hf engine
  local name="lora-0.5b-hf-fsdp$1-$2"
  item "$name" 65 "${SMALL[@]}" --engine hf --set fsdp.version="$1" --set rollout.lora_sync="$2" "${@:3}" \
    --label "$name" --json "$RAW/$name.json"
}

l1() {
  fetch vllm/c0
  hf_run 2 merged
  hf_run 2 adapter
  hf_run 1 merged
  hf_run 1 adapter
}

l2() {
  fetch vllm/c1
  item lora-0.5b-hf-offload 90 "${SMALL[@]}" --engine hf --set fsdp.cpu_offload=true \
    --set fsdp.activation_checkpointing=true --label lora-0.5b-hf-offload --json "$RAW/lora-0.5b-hf-offload.json"
  item gpu-tests 150 python3 -m pytest -q tests/test_gpu.py -rs --durations=0
}

l3() {
  fetch vllm/c2
  item model-7b 200 python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench')
from workloads import build_model_dir; print(build_model_dir('7b', Path('$MODELS')))"
}

l4() { fetch vllm/c3; }
l5() { fetch vllm/c4; }

l6() {
  fetch vllm/c5
  install_vllm || { echo "vLLM install failed"; return 1; }
  for sync in merged adapter; do
    item "lora-0.5b-vllm-fsdp2-$sync" 120 "${YARDSTICK[@]}" --set rollout.lora_sync=$sync \
      --label "lora-0.5b-vllm-fsdp2-$sync" --json "$RAW/lora-0.5b-vllm-fsdp2-$sync.json"
  done
}

l7() {  # SYNC: the faster of l6's two
  item "lora-7b-vllm-${SYNC:-adapter}" 280 python3 bench/grpo_step.py --root "$MODELS" --shape 7b --engine vllm \
    --prompts 32 --group 8 --warmup 1 --steps 4 "${LORA[@]}" --set rollout.lora_sync="${SYNC:-adapter}" \
    --label "lora-7b-vllm-${SYNC:-adapter}" --json "$RAW/lora-7b-vllm.json"
}

l8() {
  item gpu-tests-vllm 150 python3 -m pytest -q tests/test_gpu.py -k vllm -rs --durations=0
  item lora-0.5b-vllm-fsdp1-adapter 120 "${YARDSTICK[@]}" --set fsdp.version=1 --set rollout.lora_sync=adapter \
    --label lora-0.5b-vllm-fsdp1-adapter --json "$RAW/lora-0.5b-vllm-fsdp1-adapter.json"
}

case "${1:-}" in
  l1|l2|l3|l4|l5|l6|l7|l8) run_call "$1" ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
