#!/usr/bin/env bash
# The GPU session for issues 14 and 15 on one H200, as few device calls as possible, each under 10 minutes.
# Stage first, here: bash bench/stage_wheels.sh. Then, back to back (within 30 s of each other, or the
# machine goes back and /tmp is lost), from the project's root, timeout_s 600 (est. = device minutes):
#
#   call  carry (one folder each; <= 64 MiB a call)     command                                   est.
#   T0-T4 .whl/vllm/c0 .. .whl/vllm/c4                  bash bench/gpu_session.sh fetch vllm/cN    ~0.5 each (+1.5 start)
#   T5    .whl/verl/v0                                  bash bench/gpu_session.sh fetch verl/v0    ~0.5
#   T6    .whl/verl/v1                                  bash bench/gpu_session.sh fetch verl/v1    ~0.5
#   R1    .whl/vllm/c5 .whl/run                         bash bench/gpu_session.sh r1               ~9.5
#   R2    (none)                                        bash bench/gpu_session.sh r2               ~8
#   --- issue 15, a later session (a fresh machine needs T0-T4 again; r3/r4 install as r1 does) ---
#   R3    .whl/vllm/c5 .whl/run                         bash bench/gpu_session.sh r3               ~9.5
#   R4    (none, or as R3 when the machine is fresh)    bash bench/gpu_session.sh r4               ~9.5
#
# R1 (issue 14's yardstick, one machine): rlkit 0.5B vllm step + a profiled step + bare vLLM in the same
# process; TRL 0.5B HF generate and vLLM colocate; rlkit 1.5B vllm. R2: verl 0.5B; TRL 1.5B HF generate;
# tests/test_gpu.py; the sync breakdown (bench/rollout_throughput.py); rlkit 0.5B hf engine (last, optional).
# R3: issue 15's varlen workload (rlkit padded and padding-free, TRL vLLM colocate on the same lengths) and
# offload at 0.5B. R4: the 3B shape with 2,048-token responses (activation checkpointing off/on, offload on).
# Without verl (drop T5, T6): R2 skips it, ~5 minutes saved.
#
# Each item is skipped when the call's 570 s would not cover its estimate, and stopped at the call's end.
# Figures: one JSON record per item (bench/results.py), joined per call by bench/collect.py into
# $OUT/<call>.json (copy it to bench/results/), with the log in $OUT/<call>.log.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/bench-out}
RAW=/tmp/bench-raw
MODELS=/tmp/bench-models
PADDING_FREE=${PADDING_FREE:-padding_free}  # issue 15's setting, by its dotted config name
CHECKPOINTING=${CHECKPOINTING:-fsdp.activation_checkpointing}
BUDGET=${BUDGET:-570}
START=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH="$ROOT:/tmp/site"
VERL_PATH="/tmp/site-verl:/tmp/site:$ROOT"

item() {  # item NAME ESTIMATE_S COMMAND...: run COMMAND unless the call's budget cannot cover its estimate
  local name=$1 est=$2 used
  shift 2
  used=$(( $(date +%s) - START ))
  if (( used + est > BUDGET )); then
    echo "=== SKIP $name: needs ~${est} s, ${used} s of ${BUDGET} used"
    return
  fi
  echo "=== $name (estimate ${est} s, at ${used} s)"
  timeout --kill-after=15 $(( BUDGET - used )) "$@"
  echo "=== $name: exit $? after $(( $(date +%s) - START - used )) s"
}

install() {  # the carried wheels: vLLM (parts fetched earlier + c5), TRL, verl (ray parts + v1)
  mkdir -p /tmp/vp && cp .whl/vllm/c5/part5 /tmp/vp/ && cat /tmp/vp/part* > "/tmp/$(cat .whl/vllm/c5/name)" &&
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      "/tmp/$(cat .whl/vllm/c5/name)" .whl/vllm/c5/deps/*.whl .whl/run/*.whl || return 1
  if [ -f /tmp/verl/v0/part0 ] && [ -f /tmp/verl/v1/part1 ]; then
    cat /tmp/verl/v0/part0 /tmp/verl/v1/part1 > "/tmp/$(cat /tmp/verl/v1/name)" &&
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-verl \
        "/tmp/$(cat /tmp/verl/v1/name)" /tmp/verl/v1/deps/*.whl || return 1
  fi
  python3 -c "import vllm, trl; print('vllm', vllm.__version__, 'trl', trl.__version__)"
}

finish() {  # join this call's records into one file under $OUT
  python3 bench/collect.py "$OUT/$1.json" "$RAW/$1"/*.json --title "$1" || true
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
}

GRPO=(python3 bench/grpo_step.py --root "$MODELS")
TRL=(python3 bench/trl_grpo.py --root "$MODELS")

r1() {
  install || { echo "install failed"; return 1; }
  item rlkit-0.5b-vllm 200 "${GRPO[@]}" --shape 0.5b --engine vllm --steps 4 --profile --bare-vllm \
    --label rlkit-vllm --json "$RAW/r1/rlkit-0.5b-vllm.json"
  item trl-0.5b-hf 90 "${TRL[@]}" --shape 0.5b --steps 4 --label trl-hf --json "$RAW/r1/trl-0.5b-hf.json"
  item trl-0.5b-vllm 100 "${TRL[@]}" --shape 0.5b --steps 4 --vllm --label trl-vllm --json "$RAW/r1/trl-0.5b-vllm.json"
  item rlkit-1.5b-vllm 110 "${GRPO[@]}" --shape 1.5b --engine vllm --steps 3 \
    --label rlkit-vllm --json "$RAW/r1/rlkit-1.5b-vllm.json"
}

r2() {  # the GPU tests at this commit, TRL's 1.5B step, issue 15's variable lengths (padded vs packed)
  item gpu-tests 200 python3 -m pytest -x -q tests/test_gpu.py
  item trl-1.5b-hf 90 "${TRL[@]}" --shape 1.5b --steps 3 --label trl-hf --json "$RAW/r2/trl-1.5b-hf.json"
  item rlkit-varlen-packed 130 "${GRPO[@]}" --shape 0.5b --lengths varlen --steps 3 --set "$PADDING_FREE=true" \
    --label rlkit-varlen-packed --json "$RAW/r2/rlkit-varlen-packed.json"
  item rlkit-varlen-padded 150 "${GRPO[@]}" --shape 0.5b --lengths varlen --steps 3 --set "$PADDING_FREE=false" \
    --label rlkit-varlen-padded --json "$RAW/r2/rlkit-varlen-padded.json"
}

verl() {  # verl's GRPO (needs T5, T6)
  item verl-0.5b 240 env PYTHONPATH="$VERL_PATH" python3 bench/verl_grpo.py --root "$MODELS" --shape 0.5b \
    --steps 4 --label verl --json "$RAW/verl/verl-0.5b.json"
}

r3() {
  [ -d /tmp/site/vllm ] || install || return 1
  item trl-varlen-vllm 150 "${TRL[@]}" --shape 0.5b --lengths varlen --steps 3 --vllm \
    --label trl-varlen-vllm --json "$RAW/r3/trl-varlen-vllm.json"
  item rlkit-0.5b-offload 110 "${GRPO[@]}" --shape 0.5b --engine vllm --steps 3 --set fsdp.cpu_offload=true \
    --label rlkit-offload --json "$RAW/r3/rlkit-0.5b-offload.json"
}

r4() {
  [ -d /tmp/site/vllm ] || install || return 1
  local shape=(--shape 3b --prompts 16 --group 8 --response-len 2048 --micro 16 --steps 3)
  item rlkit-3b-2048 200 "${GRPO[@]}" "${shape[@]}" --label rlkit-3b --json "$RAW/r4/rlkit-3b.json"
  item rlkit-3b-2048-ac 200 "${GRPO[@]}" "${shape[@]}" --set "$CHECKPOINTING=true" \
    --label rlkit-3b-ac --json "$RAW/r4/rlkit-3b-ac.json"
  item rlkit-3b-2048-offload 200 "${GRPO[@]}" "${shape[@]}" --set fsdp.cpu_offload=true \
    --label rlkit-3b-offload --json "$RAW/r4/rlkit-3b-offload.json"
}

case "${1:-}" in
  fetch)  # a transfer call: keep the carried folder for the call that installs
    if [[ $2 == verl/* ]]; then mkdir -p "/tmp/$2" && cp -r .whl/"$2"/. "/tmp/$2/"; else mkdir -p /tmp/vp && cp .whl/"$2"/part* /tmp/vp/; fi
    du -sh /tmp/vp /tmp/verl/* 2>/dev/null ;;
  smoke)  # the first call: rlkit's GPU paths that need no vLLM, before the wheels are all carried
    mkdir -p /tmp/vp && cp .whl/vllm/c0/part* /tmp/vp/
    python3 -m pytest -x -q tests/test_packing_gpu.py "tests/test_gpu.py::test_trainer_steps_on_gpus" \
      tests/test_runtime_memory.py -k "cuda or packed or bf16 or compiled or trainer" 2>&1 | tail -30 ;;
  r1|r2|r3|r4|verl)
    mkdir -p "$OUT" "$RAW/$1"
    "$1" 2>&1 | tee "$OUT/$1.log"
    finish "$1" 2>&1 | tee -a "$OUT/$1.log" ;;
  *) sed -n '2,30p' "$0"; exit 2 ;;
esac
