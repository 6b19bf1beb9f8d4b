"""kv-canary inside other serving engines, one subpackage per engine: `sglang` (an SGLang plugin), `transformers` (HF continuous batching)."""
