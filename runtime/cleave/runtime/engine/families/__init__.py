"""Model families: each module reads one Hugging Face config family into a
:class:`~cleave.runtime.engine.families.spec.DecoderSpec`. Torch-free: the router and the loader
consult :mod:`.registry` to ask "is this model servable" without loading the engine."""
