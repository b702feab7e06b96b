"""The API process's side of the engine: text in, text out. It tokenizes and validates a
request (processor), hands token ids to the engine core (core_client: in its own process, or
llm_engine: in this one), and turns the core's token ids back into text (output_processor,
detokenizer, outputs)."""
