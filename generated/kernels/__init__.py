"""Generated kernel modules, one per variant (see ../MANIFEST)."""
