"""The engine: torch-free scheduler and block manager, a paged-KV model runner, a thin step loop."""
