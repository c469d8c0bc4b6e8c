"""Training speculators for a served target (`specserve speculator train`). Above the engine:
it drives `engine.LLMEngine` through its public API; nothing in engine/ imports it."""
