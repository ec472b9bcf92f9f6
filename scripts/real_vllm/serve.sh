#!/usr/bin/env bash
# Serve the tiny MoE model with real vLLM (CPU) on 127.0.0.1:PORT, in the foreground.
#
#   scripts/real_vllm/serve.sh [PORT] [extra vLLM args...]
#   scripts/real_vllm/serve.sh 8001 --num-gpu-blocks-override 64
#   scripts/real_vllm/serve.sh 8001 --enforce-eager      # ~25 s faster startup (skips torch.compile)
#
# Runs setup_env.sh first (a no-op when done). Served model name: tiny-moe. Ready when
# `curl http://127.0.0.1:PORT/health` answers 200 (the port is not bound until the engine loaded).
# Env: IGW_CACHE (default ~/.cache/igw), VLLM_CPU_KVCACHE_SPACE (GiB, default 1), VLLM_HOST.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${IGW_CACHE:-$HOME/.cache/igw}"
port="${1:-8001}"
[[ $# -gt 0 ]] && shift

bash "$here/setup_env.sh" >&2

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
exec "$cache/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$cache/tiny-moe" \
  --served-model-name tiny-moe \
  --max-model-len 2048 \
  --enable-prefix-caching \
  --enable-prompt-tokens-details \
  --host "${VLLM_HOST:-127.0.0.1}" \
  --port "$port" \
  "$@"
