"""`python -m backends.emulator --runtime vllm --port 0 ...` (same flags as `gateway emulate`)."""

from backends.emulator.cli import main

raise SystemExit(main())
