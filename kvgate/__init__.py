"""kvgate: KV-cache-aware admission control for multi-tenant LLM serving."""

__version__ = "0.1.0"
