"""Layer 4, process state and values: the bottom layer, which every other one may use.

Here live the process group (heartbeats, fault detection, the per-job token) and its
rendezvous store, the per-call context, the run-time config, the axis environment, the
logger, the one door to private torch APIs, the compile guard, the ``Device`` record and
the faults that cross layers.

Modules here import only from this layer (tests/test_layers.py). Nothing is re-exported
here: import the modules themselves.
"""
