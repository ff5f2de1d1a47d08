"""The call path: deploy a spec, then route calls by mode (SPMD, head-only, serving)."""
