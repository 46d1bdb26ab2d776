"""Native CPU kernels for what stock torch kernels do measurably worse (see each kernel's
comment in gemm.c, attention.c, prefill.c, layer.c), built from source on first use by the
host's C compiler (build.py) and called through ctypes (kernels.py). Where they cannot be built
or run, callers keep the stock path."""
