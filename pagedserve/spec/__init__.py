"""Speculative decoding: what proposes draft tokens and how it is configured (the engine
verifies them: scheduler.py schedules a verify, device/rejection.py accepts or rejects)."""
