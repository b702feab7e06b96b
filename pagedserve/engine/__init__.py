"""The engine core: the scheduler, its requests and the step loop (core), and the process that
runs them behind ZeroMQ (core_proc). Token ids in and out, no text."""
