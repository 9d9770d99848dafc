"""Adapters that expose other engines' op schemas on top of attn_prologue's ops.

`attn_prologue.compat.vllm`: vLLM's DeepSeek-V4 prologue ops (docs/vllm.md). Nothing here is
imported by `import attn_prologue`: an engine imports the adapter it uses.
"""
