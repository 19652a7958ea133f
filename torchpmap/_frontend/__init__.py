"""Layer 0, the private front end: what a call of ``pmap``/``vmap`` goes through before
an engine runs it.

Here live the public transforms' signatures and documentation, the call record (arguments,
``in_axes``/``out_axes`` and outputs turned into an engine-neutral ``MappedCall``),
shard_map's blocks, the check of in-place writes to shared memory, and pytree prefix
matching. (The local launcher that starts processes the way ``torchrun`` would, for the
tests and the benchmarks, is ``torchpmap.bench.launch``.)
The public modules beside this folder (``torchpmap/__init__.py``, ``training``, ``data``,
``checkpoint``, ``distributed``) are layer 0 too.

Modules here may import from this layer and every layer below (``_collectives``,
``_engines``, ``_placement``, ``_state``); nothing below imports them
(tests/test_layers.py). Nothing is re-exported here: import the modules themselves.
"""
