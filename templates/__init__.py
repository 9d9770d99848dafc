"""Jinja templates of the kernel family (package data; rendered by attn_prologue.codegen)."""
