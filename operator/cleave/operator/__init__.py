"""Control plane: the LLMService operator and autoscaler (never imports torch or the runtime)."""
