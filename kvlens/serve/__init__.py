"""The OpenAI-compatible HTTP service over the serving engine (docs/serve.md, docs/architecture.md)."""
