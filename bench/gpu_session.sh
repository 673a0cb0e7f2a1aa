#!/usr/bin/env bash
# Issue 27's lease on one H200 (nvidia-h200): every figure of the issue from one machine, in calls of about 5
# minutes (verl's alone about 8.5: its start takes 6), each writing its records under $OUT as its items finish.
# Stage first, here: bash bench/stage_wheels.sh. Print the plan with its estimates: bash bench/gpu_session.sh plan
# Then the calls, back to back (each within 30 s of the last, or the machine goes back and /tmp is lost), from
# the project's root, timeout_s 600, each carrying the folders named (<= 64 MiB with the working tree):
#
#   call  carry                          command                           items (est. s)
#   t1    .whl/vllm/c0 .whl/run          bash bench/gpu_session.sh t1      TRL HF 0.5B
#   t2    .whl/vllm/c1                   bash bench/gpu_session.sh t2      rlkit's update levers 0.5B (+ profile)
#   t3    .whl/vllm/c2                   bash bench/gpu_session.sh t3      rlkit's update 1.5B (MFU)
#   t4    .whl/vllm/c3                   bash bench/gpu_session.sh t4      tests/test_gpu.py without vLLM
#   t5    .whl/vllm/c4                   bash bench/gpu_session.sh t5      compile probe (optional)
#   r1    .whl/vllm/c5                   bash bench/gpu_session.sh r1      vLLM install; rlkit 0.5B + bare vLLM
#   r2    .whl/verl/v0                   bash bench/gpu_session.sh r2      TRL vLLM colocate 0.5B
#   r3    (nothing)                      bash bench/gpu_session.sh r3      tests/test_gpu.py with vLLM; mismatch
#   v1    .whl/verl/v1                   bash bench/gpu_session.sh v1      verl 0.9.1 0.5B (its own call, 570 s)
#
# Every item is skipped when the rest of its call's budget (BUDGET, 290 s; v1 570 s) cannot cover its estimate,
# and stopped at the budget's end. Records: $OUT/<call>/<item>.json (bench/results.py), joined per call by
# bench/collect.py into $OUT/<call>.json with the table and the ratios; the log is $OUT/<call>.log. Copy them
# to bench/results/<date>-h200/ as each call returns.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/bench-out}
MODELS=/tmp/bench-models
START=$(date +%s)
PLAN=${PLAN:-}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH="$ROOT:/tmp/site"
# the commit the records name: t1 keeps the one bench/stage_wheels.sh wrote (the copy's git metadata is stale)
[ -f .whl/run/COMMIT ] && cp .whl/run/COMMIT /tmp/rlkit-commit
RLKIT_COMMIT=${RLKIT_COMMIT:-$(cat /tmp/rlkit-commit 2>/dev/null || true)}
export RLKIT_COMMIT

item() {  # item NAME ESTIMATE_S COMMAND...: run COMMAND unless the call's budget cannot cover its estimate
  local name=$1 est=$2 used
  shift 2
  if [ -n "$PLAN" ]; then echo "$CALL $name $est"; return; fi
  used=$(( $(date +%s) - START ))
  if (( used + est > BUDGET )); then
    echo "=== SKIP $name: needs ~${est} s, ${used} s of ${BUDGET} used"
    return
  fi
  echo "=== $name (estimate ${est} s, at ${used} s)"
  timeout --kill-after=15 $(( BUDGET - used )) "$@"
  echo "=== $name: exit $? after $(( $(date +%s) - START - used )) s"
}

fetch() {  # fetch vllm/cN | verl/vN: keep this call's carried folder in /tmp for the call that installs
  [ -n "$PLAN" ] && { echo "$CALL fetch-$1 10"; return; }
  if [[ $1 == verl/* ]]; then mkdir -p "/tmp/$1" && cp -r ".whl/$1/." "/tmp/$1/"
  else mkdir -p /tmp/vp && cp ".whl/$1"/part* /tmp/vp/; fi
  du -sh /tmp/vp /tmp/verl/* 2>/dev/null
}

pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$@"; }

install_run() {  # TRL and the three packages the image lacks for it (no vLLM needed for its HF generate)
  [ -n "$PLAN" ] && { echo "$CALL install-trl 10"; return; }
  pip_target /tmp/site .whl/run/*.whl && python3 -c "import trl; print('trl', trl.__version__)"
}

install_vllm() {  # the six parts carried by t1..t5 and r1
  [ -n "$PLAN" ] && { echo "$CALL install-vllm 35"; return; }
  local name
  name=$(cat .whl/vllm/c5/name)
  cp .whl/vllm/c5/part5 /tmp/vp/ && cat /tmp/vp/part* > "/tmp/$name" &&
    pip_target /tmp/site "/tmp/$name" .whl/vllm/c5/deps/*.whl && python3 -c "import vllm; print('vllm', vllm.__version__)"
}

install_verl() {  # Ray (split over v0 and v1), verl and its pins in their own target, TRL kept off verl's path
  [ -n "$PLAN" ] && { echo "$CALL install-verl 25"; return; }
  cat /tmp/verl/v0/part0 /tmp/verl/v1/part1 > "/tmp/$(cat /tmp/verl/v1/name)" &&
    pip_target /tmp/site-verl "/tmp/$(cat /tmp/verl/v1/name)" /tmp/verl/v1/deps/*.whl || return 1
  # verl's monkey patch imports TRL whenever it is importable, and fails on TRL 1.16 (GPU.md)
  [ -d /tmp/site/trl ] && mv /tmp/site/trl /tmp/trl-aside
  # what verl and vLLM's server import at module level that no staged wheel provides (bench/wheel_imports.py):
  # the 2026-12-02 run found them on the image; a missing one is the blocker to report
  PYTHONPATH="/tmp/site-verl:/tmp/site" python3 -c "import importlib.util as u; m = ['PIL', 'anyio', 'click',
    'cloudpickle', 'cpuinfo', 'peft', 'prometheus_client', 'pyarrow', 'xxhash', 'annotated_doc', 'watchfiles',
    'tokenizers', 'transformers', 'ray', 'verl', 'vllm']; print('not importable:', [n for n in m if u.find_spec(n) is None])"
}

GRPO=(python3 bench/grpo_step.py --root "$MODELS" --warmup 2 --steps 8)
TRL=(python3 bench/trl_grpo.py --root "$MODELS" --warmup 2 --steps 8)
LEVERS=(python3 bench/update_levers.py --root "$MODELS" --warmup 1 --steps 8)

t1() {
  fetch vllm/c0
  install_run
  item trl-0.5b-hf 125 "${TRL[@]}" --shape 0.5b --label trl-hf --json "$RAW/trl-0.5b-hf.json"
}

t2() {  # the update's levers against each other on one batch, and one profiled update of the new default
  fetch vllm/c1
  item update-0.5b 150 "${LEVERS[@]}" --shape 0.5b --variants reshard+eager keep+eager keep+fused \
    keep+fused+micro128 --profile keep+fused --label rlkit-update --json "$RAW/update-0.5b.json"
}

t3() {  # the 1.5B update's MFU with the defaults
  fetch vllm/c2
  item update-1.5b 150 "${LEVERS[@]}" --shape 1.5b --variants keep+fused --label rlkit-update-1.5b \
    --json "$RAW/update-1.5b.json"
}

t4() {  # the GPU tests that need no vLLM (its two tests skip until r3)
  fetch vllm/c3
  item gpu-tests 120 python3 -m pytest -q tests/test_gpu.py -rs --durations=0
}

t5() {  # optional: where torch.compile stands for the decoder layers and the head on this image, and why
  fetch vllm/c4
  item compile-probe 160 python3 bench/compile_probe.py --root "$MODELS" --shape 0.5b --json "$RAW/compile-probe.json"
}

r1() {  # rlkit's step with bare vLLM alternating on the same rollout, the engine call taken apart above 1.15x
  fetch vllm/c5
  install_vllm || { echo "vLLM install failed"; return 1; }
  # two engine starts and 10 steps with two bare generations each took ~270 s on 2026-12-02: the breakdown and
  # the profile (15 more engine calls, one more step) do not fit beside them in one call
  item rlkit-0.5b-vllm 270 "${GRPO[@]}" --shape 0.5b --engine vllm --bare-vllm --breakdown-above 99 \
    --label rlkit-vllm --json "$RAW/rlkit-0.5b-vllm.json"
}

r2() {
  fetch verl/v0
  item trl-0.5b-vllm 185 "${TRL[@]}" --shape 0.5b --vllm --label trl-vllm --json "$RAW/trl-0.5b-vllm.json"
}

r3() {  # the GPU tests that need vLLM; the mismatch figures (bench/mismatch.py, issue 25) where that bench exists
  item gpu-tests-vllm 150 python3 -m pytest -q tests/test_gpu.py -k vllm -rs --durations=0
  if [ -f bench/mismatch.py ]; then
    item mismatch 175 python3 bench/mismatch.py --root "$MODELS" --shape 0.5b --engine vllm --steps 4 \
      --label rlkit-mismatch --json "$RAW/mismatch.json"
  fi
}

v1() {  # verl 0.9.1 with the settings bench/verl_grpo.py documents; stopped at 510 s with the steps it logged
  fetch verl/v1
  install_verl || { echo "verl install failed"; return 1; }
  item verl-0.5b 510 env PYTHONPATH="/tmp/site-verl:/tmp/site:$ROOT" python3 bench/verl_grpo.py --root "$MODELS" \
    --shape 0.5b --warmup 2 --steps 8 --timeout 500 --label verl --json "$RAW/verl-0.5b.json"
}

CALLS=(t1 t2 t3 t4 t5 r1 r2 r3 v1)
CALL_OVERHEAD=15  # seconds a call costs besides its items (carrying, starting the command)
MACHINE_START=90

plan() {  # the calls' items and estimates, and the totals
  PLAN=1 RAW=""
  local lines
  lines=$(for CALL in "${CALLS[@]}"; do "$CALL"; done)
  echo "$lines" | awk -v start="$MACHINE_START" -v over="$CALL_OVERHEAD" '
    { per[$1] += $3; printf "  %-4s %-16s %5d s\n", $1, $2, $3; if ($2 ~ /compile-probe|mismatch/) opt += $3 }
    END { for (c in per) { total += per[c] + over; n++ }
          printf "machine start %d s + %d calls x %d s + items: %d s = %.1f min; without the optional items ", \
            start, n, over, total + start, (total + start) / 60
          printf "(compile-probe, mismatch) %.1f min; without verl too %.1f min\n", (total + start - opt) / 60, \
            (total + start - opt - per["v1"] - over) / 60 }'
}

run_call() {  # run_call CALL [BUDGET]: the call's items under its budget (default 290 s), its log and records
  CALL=$1 RAW="$OUT/$1" BUDGET=${BUDGET:-${2:-290}}
  mkdir -p "$RAW"
  "$1" 2>&1 | tee "$OUT/$1.log"
  { python3 bench/collect.py "$OUT/$1.json" "$RAW"/*.json --title "$1" || true
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true; } 2>&1 | tee -a "$OUT/$1.log"
}

# sourced (bench/lora_session.sh, bench/sizes_session.sh): the functions above only
[[ "${BASH_SOURCE[0]}" != "$0" ]] && return 0

case "${1:-}" in
  plan) plan ;;
  t1|t2|t3|t4|t5|r1|r2|r3|v1) run_call "$1" "$([ "$1" = v1 ] && echo 570 || echo 290)" ;;
  *) sed -n '2,25p' "$0"; exit 2 ;;
esac
