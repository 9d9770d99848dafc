"""Device code shared by every generated kernel module (imports only the DSL)."""
