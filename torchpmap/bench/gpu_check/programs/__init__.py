"""The programs of the GPU check's parts: each runs as ``python -m
torchpmap.bench.gpu_check.programs.NAME`` in a process of its own and reports through a
:class:`~torchpmap.bench.gpu_check.programs.common.Recorder`."""
