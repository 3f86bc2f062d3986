"""Speculative decoding: settings, drafting, verification and acceptance."""
