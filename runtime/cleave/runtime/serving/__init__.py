"""Serving: the worker's internal HTTP API and the router's OpenAI-compatible one."""
