"""Layer 3, devices and meshes: where the instances of a map run and where results live.

Here live the devices a pmap can run on, ``Mesh`` (devices in an n-D grid with named axes)
and ``ShardedTensor`` (a result that stays on the devices that computed it).

Modules here may import from this layer and the one below (``_state``), never from the
engines, the collectives or the front end (tests/test_layers.py). Nothing is re-exported
here: import the modules themselves.
"""
