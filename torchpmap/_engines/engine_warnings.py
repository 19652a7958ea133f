"""The warnings the engines give when a call runs another way than asked: slower, same results."""


class VectorizationFallbackWarning(UserWarning):
    """``torch.func.vmap`` could not run a mapped function, whose instances then ran one at
    a time (same results, slower)."""


class JitFallbackWarning(UserWarning):
    """``pmap(jit=True)`` could not compile a call, which ran eagerly instead."""


class JitRecompileWarning(UserWarning):
    """A ``pmap(jit=True)`` function traces and compiles on most of its calls."""
