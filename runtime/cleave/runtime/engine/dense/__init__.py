"""The shared dense decoder: small parts (norms, rotary, paged attention, MLP) assembled from a
:class:`~cleave.runtime.engine.families.spec.DecoderSpec`."""
