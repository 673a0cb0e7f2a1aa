#!/usr/bin/env bash
# Issue 44's lease on one H100 (the default kind): the default step (no settings: the memory plan's) beside TRL at
# 0.5B and 1.5B, bare vLLM paired in the same process, the GPU tests under the new defaults, and fsdp.compile on
# varied lengths. Calls of under 5 minutes, back to back (each within 30 s of the last, or the machine goes back and
# /tmp is lost), from the project's root, timeout_s 600; the helpers are bench/gpu_session.sh's.
# Stage first, here: SKIP_VERL=1 bash bench/stage_wheels.sh (then git rev-parse --short HEAD > .whl/run/COMMIT).
#
#   call  carry                  command                          items
#   d1    .whl/vllm/c0 .whl/run  bash bench/speed_session.sh d1   TRL install; model folders; TRL HF 0.5B
#   d2    .whl/vllm/c1           bash bench/speed_session.sh d2   with TRL_15B=1: TRL HF 1.5B (its default checkpointing)
#   d3    .whl/vllm/c2           bash bench/speed_session.sh d3   (carry only)
#   d4    .whl/vllm/c3           bash bench/speed_session.sh d4   (carry only)
#   d5    .whl/vllm/c4           bash bench/speed_session.sh d5   (carry only)
#   d6    .whl/vllm/c5           bash bench/speed_session.sh d6   vLLM install; rlkit 0.5B, no settings, bare vLLM paired
#                                  (BREAKDOWN=1.05: the engine call taken apart above 1.05x, ~100 s more)
#   d7    (nothing)              bash bench/speed_session.sh d7   rlkit 1.5B, no settings
#   d8    (nothing)              bash bench/speed_session.sh d8   varied lengths: compile (the default) and eager
#   d9    (nothing)              bash bench/speed_session.sh d9   LoRA r=16 0.5B update: compiled (the default), eager
#   d10   (nothing)              bash bench/speed_session.sh d10  tests/test_gpu.py (the new defaults), if time is left
#
# Records: $OUT/<call>/<item>.json and $OUT/<call>.log; copy them to bench/results/<date>-h100/ as each returns.
set -uo pipefail
source "$(dirname "$0")/gpu_session.sh"

models() {  # the random-weight model folders, filled on the GPU in a process of their own
  item "models-$*" 60 python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench')
from workloads import build_model_dir
for shape in sys.argv[1:]: print(build_model_dir(shape, Path('$MODELS')))" "$@"
}

d1() {
  fetch vllm/c0
  install_run
  models 0.5b
  item trl-0.5b-hf 150 "${TRL[@]}" --shape 0.5b --label trl-hf --json "$RAW/trl-0.5b-hf.json"
}

d2() {  # TRL_15B=1: TRL's 1.5B step too (about 200 s)
  fetch vllm/c1
  [ "${TRL_15B:-}" = 1 ] || return 0
  models 1.5b
  item trl-1.5b-hf 230 "${TRL[@]}" --shape 1.5b --gradient-checkpointing --label trl-hf-1.5b \
    --json "$RAW/trl-1.5b-hf.json"
}

d3() { fetch vllm/c2; }

d4() { fetch vllm/c3; }
d5() { fetch vllm/c4; }

d6() {  # the first vLLM run of a fresh machine compiles vLLM's and rlkit's graphs cold: a longer budget
  fetch vllm/c5
  install_vllm || { echo "vLLM install failed"; return 1; }
  item rlkit-0.5b-defaults 500 "${GRPO[@]}" --shape 0.5b --engine vllm --bare-vllm --breakdown-above "${BREAKDOWN:-99}" \
    --label rlkit-defaults --json "$RAW/rlkit-0.5b-defaults.json"
}

d7() {
  models 1.5b
  item rlkit-1.5b-defaults 280 "${GRPO[@]}" --shape 1.5b --engine vllm --label rlkit-defaults-1.5b \
    --json "$RAW/rlkit-1.5b-defaults.json"
}

d8() {  # issue 15's varied lengths (16-2,048 tokens), 32 prompts x 8: the compiled update against eager, one call
  local varlen=(python3 bench/grpo_step.py --root "$MODELS" --shape 0.5b --engine vllm --lengths varlen --prompts 32
    --warmup 1 --steps 4)
  item varlen-compile 140 "${varlen[@]}" --label varlen-compile --json "$RAW/varlen-compile.json"
  item varlen-eager 140 "${varlen[@]}" --set fsdp.compile=false --label varlen-eager --json "$RAW/varlen-eager.json"
}

d9() {  # LoRA's update under compile against eager, each its own process (compile is fixed when a model is built)
  local lora=(python3 bench/update_levers.py --root "$MODELS" --warmup 1 --steps 8 --variants keep+fused --shape 0.5b
    --set lora.rank=16)
  item lora-update-compile 80 "${lora[@]}" --label lora-compile --json "$RAW/lora-update-compile.json"
  item lora-update-eager 80 "${lora[@]}" --set fsdp.compile=false --label lora-eager --json "$RAW/lora-update-eager.json"
}

d10() {
  item gpu-tests 280 python3 -m pytest -q tests/test_gpu.py -rs --durations=0
}

case "${1:-}" in
  d1|d2|d3|d4|d5|d7|d8|d9|d10) run_call "$1" ;;
  d6) run_call d6 540 ;;
  *) sed -n '2,18p' "$0"; exit 2 ;;
esac
