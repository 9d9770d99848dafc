"""Checked-in output of `python -m attn_prologue generate`: kernel modules, MANIFEST, registry.

Only `generate` writes below this folder (except this file); a test runs `generate --check`."""
