"""kv-canary code generator: kernels.yaml -> generated/ (see docs/schema.md)."""
