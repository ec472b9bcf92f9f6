"""Data the tests read, vendored so a clean clone needs nothing beside it.

`vllm-0.32.0-cpu/`: transcripts of a real vLLM 0.32.0 server (provenance in its README.md), read by
the adapters' unit tests (`tests/unit/backends/captures.py`) and replayed against the vLLM emulator
(`tests/emulator/test_vllm_captures.py`).
`vllm-0.32.0-cpu-pd/`: a real prefill/decode pair's legs (two vLLM 0.32.0 servers sharing KV through
ExampleConnector's files), recorded by scripts/real_vllm/record_pd.py (provenance in its README.md).
Read by `tests/unit/pd/test_vllm_pd_captures.py`, replayed against two emulators
(`tests/emulator/test_vllm_pd_captures.py`).
`emulator/`: more real vLLM 0.32 transcripts (Responses, tool calls, embeddings) and KV-event encodings,
recorded for the emulator's newer surfaces (provenance in its README.md).
"""

from pathlib import Path

VLLM_CAPTURES = Path(__file__).resolve().parent / "vllm-0.32.0-cpu"
EMULATOR_CAPTURES = Path(__file__).resolve().parent / "emulator"
VLLM_PD_CAPTURES = Path(__file__).resolve().parent / "vllm-0.32.0-cpu-pd"
