"""The device side: what runs a model step. The executor (in the engine core's process) drives
one model runner in process, or one worker per tensor-parallel rank; a runner owns the weights,
the KV cache, the step's input buffers, CUDA graphs and the sampler."""
