"""Finding, converting and loading models; device and dtype selection."""
