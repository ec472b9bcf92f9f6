"""vLLM's `ExampleConnector` (formerly `SharedStorageConnector`): KV in files under a directory
every server of the pair mounts (`kv_connector_extra_config.shared_storage_path`) (I/O).

As in `example_connector.py`: a prompt's KV lives in a folder named by a hash of its first
`align_to_block_size(len(prompt) - 1)` token ids; a server (`kv_both`) that finds the folder loads
those tokens (`get_num_new_matched_tokens`: aligned - locally computed) instead of computing them, and
one that does not find it writes it after the prefill. No `kv_transfer_params` are exchanged: the
decode finds the KV by its prompt alone. The emulator writes one small file per prompt (the real
connector writes one safetensors file per layer), so two emulator processes sharing the directory
see each other's KV.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

MARKER = "emulated_kv.txt"


def align_to_block_size(num_tokens: int, block_size: int) -> int:
    """The connector's alignment: `(n - 1) // block_size * block_size` (0 for n <= 0)."""
    if num_tokens <= 0:
        return 0
    return (num_tokens - 1) // block_size * block_size


class SharedStorage:
    def __init__(self, path: str, block_size: int) -> None:
        self.root = Path(path)
        self.block_size = block_size

    def _aligned(self, prompt: Sequence[int]) -> int:
        return align_to_block_size(len(prompt) - 1, self.block_size)

    def _folder(self, tokens: Sequence[int]) -> Path:
        data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)
        return self.root / hashlib.md5(data, usedforsecurity=False).hexdigest()

    def lookup(self, prompt: Sequence[int]) -> int:
        """Prompt tokens whose KV is stored (0 when none)."""
        n = self._aligned(prompt)
        if n <= 0:
            return 0
        return n if (self._folder(prompt[:n]) / MARKER).exists() else 0

    def store(self, prompt: Sequence[int]) -> bool:
        """Write the prompt's KV unless it is already stored; True when written."""
        n = self._aligned(prompt)
        if n <= 0:
            return False
        folder = self._folder(prompt[:n])
        if (folder / MARKER).exists():
            return False
        os.makedirs(folder, exist_ok=True)
        tmp = folder / f".{MARKER}.{os.getpid()}"
        tmp.write_text(f"{n}\n")
        tmp.replace(folder / MARKER)  # atomic: a reader never sees half a marker
        return True
