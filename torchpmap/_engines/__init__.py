"""Layer 2, engines: what runs the instances of a mapped call.

The front end hands a :class:`~torchpmap._engines.mapped_call.MappedCall` (the call
record) to :func:`torchpmap._engines.dispatch.run` (the engine choice). The engines:

* :mod:`~torchpmap._engines.vectorized`: all instances in one ``torch.func.vmap``;
* :mod:`~torchpmap._engines.compiled`: ``jit=True``, the vectorized program traced and compiled;
* :mod:`~torchpmap._engines.multi_device`: one thread per device;
* :mod:`~torchpmap._engines.compiled_devices`: ``jit=True`` on several devices, a compiled slice per device thread;
* :mod:`~torchpmap._engines.mesh_axes`: one thread per position along a mesh axis;
* :mod:`~torchpmap._engines.one_at_a_time`: one instance at a time (debug mode, vmap fallback);
* :mod:`~torchpmap._engines.multi_process`: one slice of the axis per process.

Modules here may import from this layer and those below (``_placement``, ``_state``),
never from the collectives or the front end (tests/test_layers.py). Nothing is defined or
re-exported here: import the modules themselves.
"""
