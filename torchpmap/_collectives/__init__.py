"""Layer 1, collectives: communication between the instances of a mapped axis.

Here live the public collectives (argument checks, tuple axes, pytrees), the math of each
collective over all instances of an axis, and its binding: the ``autograd.Function`` and
vmap rule that find the vmap level owning the axis.

Modules here may import from this layer and those below (``_engines``, ``_placement``,
``_state``), never from the front end (tests/test_layers.py). Nothing is re-exported here:
import the modules themselves.
"""
