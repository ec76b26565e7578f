#!/usr/bin/env bash
# The GPU tier in one call on a lent GPU machine (the `device` tool's `run`), results under $OUT:
#   1. pytest tests/gpu -m gpu  (CUDA RNG capture/restore, pinned side-stream capture, SCOUT replay on CUDA;
#      Megatron/TorchTitan tests
#      skip there unless those frameworks are installed)      -> gpu-tier-junit.xml, gpu-tier-pytest.log
#   2. qualification.bench.gemini_cuda: the capture's stall and D2H bandwidth vs the raw pinned copy, and how much
#      of the copy hides under compute                          -> gemini-cuda-bench.json
#   3. the healthy-path modes on CUDA tensors (2 ranks sharing the GPU over gloo)  -> healthy-path-cuda.json
#
# The machine has python3 with a CUDA torch but not blake3: prepare its wheel here first (ignored by git):
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl blake3==1.0.11
# then run:  run(command="bash scripts/gpu_tier.sh", carry=[".whl"], timeout_s=540)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-tier}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_tier: wheel install failed" >&2; exit 2; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'; } \
  >"$OUT/gpu-tier-host.txt" 2>&1
status=0
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu --timeout 200 \
  --junitxml "$OUT/gpu-tier-junit.xml" >"$OUT/gpu-tier-pytest.log" 2>&1 || status=1
timeout 180 python3 -m qualification.bench.gemini_cuda --sizes-mib 256,1024 --out "$OUT/gemini-cuda-bench.json" \
  >"$OUT/gemini-cuda-bench.log" 2>&1 || status=1
# The healthy-path cell of campaigns/gpu-qualification.toml, run through its cell program (no sealing here: the
# machine lacks jsonschema/cryptography; the result JSON comes back and is sealed on the CPU side).
cat >/tmp/hp-cell.json <<'CELL'
{"id": "gpu-qualification/healthy-path-cuda", "program": "healthy_path", "workload": "three-block",
 "topology": "ddp", "world_size": 2, "seed": 0, "timeout_s": 150, "fault": {"kind": "none"},
 "params": {"modes": ["baseline", "gemini", "scout", "combined"], "rounds": 1, "steps": 40, "warmup": 5,
            "interval": 10, "device": "cuda"}}
CELL
timeout 200 python3 -m qualification.programs.healthy_path --cell /tmp/hp-cell.json --out /tmp/hp-cuda \
  >"$OUT/healthy-path-cuda.log" 2>&1 || status=1
cp /tmp/hp-cuda/result.json "$OUT/healthy-path-cuda.json" 2>/dev/null || status=1
tail -n 3 "$OUT"/*.log
exit $status
