#!/usr/bin/env bash
# Stage every wheel bench/gpu_session.sh and bench/acceptance.sh carry to the GPU under .whl/ (ignored by git), in
# folders of at most ~55 MiB (a device call carries 64 MiB with the working tree). Run here, from the project's root:
#   .whl/vllm/c0..c5  vLLM 0.24.0 + what `from vllm import LLM` needs (../shared/gpu/vllm-wheels.sh; ~300 MB)
#   .whl/run          TRL 1.16.0 and the three packages the image lacks for it, Liger Kernel 0.8.5 (rlkit[kernels];
#                     Triton comes with the image's torch), and the commit (2 MB)
#   .whl/tinker       the Tinker SDK 0.38.0 (rlkit[tinker]) and its dependencies, for bench/acceptance.sh's Tinker
#                     item, installed in a target of their own behind vLLM's (17 MB; carried with .whl/vllm/c5)
#   .whl/verl/v0, v1  verl 0.9.1, Ray 2.60.0 (split in two), transformers 5.9.0 (verl's pin: <5.11, the
#                     image has 5.17) with tokenizers 0.22.2 (5.9 refuses the image's 0.23), verl's other missing
#                     packages and what vLLM's OpenAI server (verl's rollout) imports (~95 MB; ../shared/gpu/GPU.md)
# Prints the sizes. Python 3.12, manylinux x86_64 (the image's); antlr4 (hydra's) exists only as an sdist,
# so its pure-Python wheel is built here.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
get() { python3 -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$1" "${@:2}" 2>&1 | grep -v 'is ignored' || true; }

# ../shared beside the main checkout; .whl/ is in .gitignore, so vllm-wheels.sh's line for git's exclude file
# (a worktree's .git is a file) is pointed at /dev/null
shared=$(cd "$(git rev-parse --git-common-dir)/../../shared" && pwd)
[ -f .whl/vllm/c5/name ] || [ -n "${SKIP_VLLM:-}" ] || sed "s#\.git/info/exclude#/dev/null#g" "$shared/gpu/vllm-wheels.sh" | bash

rm -rf .whl/run && mkdir -p .whl/run
get .whl/run trl==1.16.0 datasets==4.8.4 dill==0.4.0 multiprocess==0.70.18 liger-kernel==0.8.5
git describe --always --dirty > .whl/run/COMMIT  # the code's commit, for the records (re-run before a lease)
rm -rf .whl/tinker && mkdir -p .whl/tinker
get .whl/tinker tinker==0.38.0 anyio==4.16.0 click==8.5.1 distro==1.9.0 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 \
  h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 certifi==2026.10.19.post1 idna==3.21 orjson==3.13.0 protobuf==7.36.2 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 pyqwest==0.12.0 \
  opentelemetry-api==1.45.2 importlib-metadata==10.2.0 zipp==4.1.2 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
  pygments==2.21.0 sniffio==1.3.1 typing-extensions==4.16.0 zstandard==0.25.0
[ -n "${SKIP_VERL:-}" ] && { du -sh .whl/vllm/c* .whl/run .whl/tinker; exit 0; }  # leases that do not run verl

rm -rf .whl/verl && mkdir -p .whl/verl/dl .whl/verl/v0 .whl/verl/v1/deps
get .whl/verl/v1/deps verl==0.9.1 transformers==5.9.0 hydra-core==1.3.2 omegaconf==2.3.0 tensordict==0.10.0 \
  pyvers==0.1.0 transferqueue==0.1.11 codetiming==1.4.0 torchdata==0.11.0 pylatexenc==2.11 orjson==3.13.0 \
  uvicorn==0.54.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  importlib-metadata==10.2.0 tokenizers==0.22.2 watchfiles==1.3.0 model-hosting-container-standards==0.1.16 \
  jmespath==1.1.0 prometheus-fastapi-instrumentator==8.1.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 \
  setproctitle==1.3.8
python3 -m pip wheel -q --no-deps -w .whl/verl/v1/deps antlr4-python3-runtime==4.9.3 2>&1 | grep -v 'is ignored' || true
get .whl/verl/dl ray==2.60.0
ray=$(ls .whl/verl/dl/ray-2.60.0-*.whl)
split -b 40M -d -a 1 "$ray" .whl/verl/dl/part
mv .whl/verl/dl/part0 .whl/verl/v0/ && mv .whl/verl/dl/part1 .whl/verl/v1/
basename "$ray" > .whl/verl/v1/name
rm -rf .whl/verl/dl
du -sh .whl/vllm/c* .whl/run .whl/tinker .whl/verl/v0 .whl/verl/v1
