"""Backend adapters, one per serving runtime, and the runtime emulators.

Nothing in this package imports `gateway`: adapters are pure translations plus the facts the gateway's
I/O layer needs (which path to probe, how to parse what comes back).
"""
