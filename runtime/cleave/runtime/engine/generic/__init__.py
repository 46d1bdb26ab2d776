"""The generic path: any transformers causal LM, its own forward, attention over the paged pool
(registered as transformers' ``cleave_paged`` attention implementation)."""
