"""Grammar-constrained decoding: the output of a request is held to a JSON schema, any JSON
object, a regular expression, a fixed set of choices or an EBNF grammar.

The grammar engine is xgrammar, chosen over llguidance because it is the default of vLLM
and SGLang (the most exercised in serving), ships CPU wheels, compiles JSON schemas,
regexes and EBNF with one compiler that caches per-tokenizer token tables, and gives us
exactly the two primitives a continuous-batching engine needs: a per-request matcher that
fills a packed token bitmask (one bit per vocabulary entry) for the next step on the host,
and an in-place masked fill of the logits on the device (a Triton kernel on CUDA).

    params.py   StructuredOutputsParams: the one SamplingParams field that asks for it
    grammar.py  GrammarCache: compiles each grammar once per (kind, spec) for the tokenizer
    backend.py  GrammarBackend: the Protocol the engine core holds, implemented by the two below
    manager.py  StructuredOutputManager: grammars compiled in the background (the request
                waits meanwhile), one matcher per constrained request in the engine core,
                the bitmask of a step's constrained rows, advancing on sampled tokens
    remote.py   GrammarProcess: the manager in a child process (the default on a GPU)
    bitmask.py  applying a step's bitmask to the logits (the sampler's hook)
"""
