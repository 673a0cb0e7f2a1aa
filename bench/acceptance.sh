#!/usr/bin/env bash
# Issue 43's acceptance matrix: every GPU path at small size in one lease on one GPU (an H100 by default), in
# calls of under 5 minutes, each recording its items' pass/fail into $OUT/acceptance.json (bench/acceptance.py;
# the items are bench/acceptance_items.py's, `python3 bench/acceptance.py --list` names them). The helpers are
# bench/gpu_session.sh's. Stage first, here: SKIP_VERL=1 bash bench/stage_wheels.sh. Print the plan with its
# estimates: bash bench/acceptance.sh plan. Then the calls, back to back (each within 30 s of the last, or the
# machine goes back and /tmp is lost), from the project's root, timeout_s 600, each carrying the folders named:
#
#   call  carry                       command                       items
#   a1    .whl/vllm/c0 .whl/run       bash bench/acceptance.sh a1   GRPO hf; LoRA FSDP1 untied, merged and adapter sync
#   a2    .whl/vllm/c1                bash bench/acceptance.sh a2   PPO, DPO, KTO
#   a3    .whl/vllm/c2                bash bench/acceptance.sh a3   fsdp.compile, Liger
#   a4    .whl/vllm/c3                bash bench/acceptance.sh a4   checkpoint; LoRA FSDP2 tied, adapter sync
#   a5    .whl/vllm/c4                bash bench/acceptance.sh a5   LoRA FSDP2 untied merged; FSDP1 tied refused
#   a6    .whl/vllm/c5 .whl/tinker    bash bench/acceptance.sh a6   vLLM + Tinker SDK install; GRPO vLLM, certify()
#   a7    (nothing)                   bash bench/acceptance.sh a7   a driver killed (SIGTERM, SIGKILL); agentic x2
#   a8    (nothing)                   bash bench/acceptance.sh a8   the correction on; LoRA adapter sync into vLLM; Tinker
#
# A call continues the record the last call left in /tmp (a fresh machine: the committed one named by
# ACCEPTANCE_RECORD, if any); an item already in it is replaced. Items the rest of a call's budget (BUDGET, 270 s)
# cannot cover are recorded as not run. Call `bash bench/acceptance.sh aN` again to re-run a call's items (a6 after
# a fresh machine needs a1..a5's parts again). Copy $OUT/acceptance.json to bench/results/<date>-<card>/ and
# commit it as each call returns, with $OUT/<call>.log ($OUT/<call>.json holds the items' bench records, the
# estimate beside every phase's measured peak).
set -uo pipefail
source "$(dirname "$0")/gpu_session.sh"
export PYTHONPATH="$PYTHONPATH:/tmp/site-tinker"  # after /tmp/site: vLLM's pins win over the SDK's

accept() {  # accept ITEM...: the items, under the rest of the call's budget, into $OUT/acceptance.json
  # shellcheck disable=SC2086  # ITEMS (set, even empty): these items instead of the call's, e.g. a lease short of
  [ -n "${ITEMS+x}" ] && set -- $ITEMS  # time, or one that re-runs what failed; the call still carries its part
  [ $# -eq 0 ] && return 0
  if [ -n "$PLAN" ]; then
    for name in "$@"; do echo "$CALL $name ${ESTIMATES[$name]}"; done
    return
  fi
  local used=$(( $(date +%s) - START ))
  # shellcheck disable=SC2086  # ACCEPTANCE_ARGS: more options, e.g. "--device cpu --shape tiny --slow 5" (a dry run)
  python3 bench/acceptance.py --out "$OUT/acceptance.json" --budget $(( BUDGET - used )) --root "$MODELS" \
    --raw "$RAW" ${ACCEPTANCE_ARGS:-} "$@"
}

install_tinker() {  # the Tinker SDK 0.38 and its dependencies, in a target of their own (last on the path)
  [ -n "$PLAN" ] && { echo "$CALL install-tinker 5"; return; }
  pip_target /tmp/site-tinker .whl/tinker/*.whl && python3 -c "import tinker; print('tinker', tinker.__version__)"
}

install_liger() {  # Liger Kernel from .whl/run (Triton comes with the image's torch)
  [ -n "$PLAN" ] && { echo "$CALL install-liger 5"; return; }
  pip_target /tmp/site .whl/run/liger_kernel-*.whl && python3 -c "import liger_kernel; print('liger-kernel ok')"
}

a1() {
  fetch vllm/c0
  install_liger
  accept grpo-hf lora-fsdp1-untied-merged lora-fsdp1-untied-adapter
}

# the calls that carry vLLM's parts run the other hf items: a machine is paid for while it is held
a2() { fetch vllm/c1; accept ppo dpo kto; }
a3() { fetch vllm/c2; accept compile liger; }
a4() { fetch vllm/c3; accept checkpoint lora-fsdp2-tied-adapter; }
a5() { fetch vllm/c4; accept lora-fsdp2-untied-merged lora-fsdp1-tied-refused; }

a6() {
  fetch vllm/c5
  install_vllm || { echo "vLLM install failed"; return 1; }
  install_tinker
  accept grpo-vllm certify-vllm  # the first engine start compiles
}

a7() { accept kill-sigterm kill-sigkill agentic-tool agentic-env; }
a8() { accept correction-vllm lora-vllm-adapter tinker; }

CALLS=(a1 a2 a3 a4 a5 a6 a7 a8)
declare -A ESTIMATES=()

estimates() {  # item -> estimated seconds, from bench/acceptance.py --list
  local name est _
  while read -r name est _; do ESTIMATES[$name]=$est; done < <(python3 bench/acceptance.py --list)
}

acceptance_plan() {  # the calls' items and estimates, and the total
  PLAN=1 RAW=""
  estimates
  local lines
  lines=$(for CALL in "${CALLS[@]}"; do "$CALL"; done)
  echo "$lines" | awk -v start="$MACHINE_START" -v over="$CALL_OVERHEAD" -v budget=270 '
    { per[$1] += $3; printf "  %-4s %-28s %5d s\n", $1, $2, $3 }
    END { for (c in per) { total += per[c] + over; if (per[c] > budget) late = late " " c }
          for (i = 1; i <= 8; i++) printf "%s%s %d s", (i == 1 ? "per call: " : ", "), "a" i, per["a" i]
          printf "\nmachine start %d s + 8 calls x %d s + items: %.1f min of device time\n", start, over, \
            (total + start) / 60
          if (late) print "over the 270 s budget (their last items will be skipped):" late }'
}

seed_record() {  # this call continues the record the last call left (warm machine) or the committed one
  if [ -f /tmp/acceptance.json ]; then cp /tmp/acceptance.json "$OUT/"
  elif [ -n "${ACCEPTANCE_RECORD:-}" ] && [ -f "$ACCEPTANCE_RECORD" ]; then cp "$ACCEPTANCE_RECORD" "$OUT/acceptance.json"
  fi
}

case "${1:-}" in
  plan) acceptance_plan ;;
  a1|a2|a3|a4|a5|a6|a7|a8)
    mkdir -p "$OUT" && seed_record
    run_call "$1" 270
    [ -f "$OUT/acceptance.json" ] && cp "$OUT/acceptance.json" /tmp/acceptance.json
    rm -rf "${OUT:?}/$1"  # its records are in $OUT/$1.json (at most 8 files come back)
    ;;
  *) sed -n '2,27p' "$0"; exit 2 ;;
esac
