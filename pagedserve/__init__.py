"""pagedserve: an LLM serving engine built around a paged KV cache."""
