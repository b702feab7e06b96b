"""The engine: scheduler, model runner, sampler, detokenizer and LLMEngine."""
