"""``make gpu-check``: one prepared command that tells what works on a CUDA machine.

A session on a machine with a GPU may have minutes, not hours, and nothing to install
with. This check runs, in one command and within a time budget, every part of torchpmap
that behaves differently on CUDA, each in a process of its own (a crash or a hang in one
part leaves the others' outcomes), and writes what it found as Markdown and JSON:

========================  =====================================================================
part                      what it checks
========================  =====================================================================
``versions``              the private-API door's probes (``torch_private.check()``), versions
``tests``                 the device-equivalence, API, sharded, multi-device and autocast
                          tests with CUDA as the device (instances on the one GPU, vectorized)
``tests-sharded-step``    the sharded-step, layer-gather and written-copy tests, likewise
``tests-shard-map``       the shard_map and output-copy tests, likewise
``tests-rnn``             the RNN-rule tests, likewise
``tests-mixed``           the API and multi-device tests on CUDA and CPU devices together
``jit``                   ``pmap(jit=True)`` (inductor, Triton) against eager: values, gradients
``step``                  ``data_parallel_step`` against plain PyTorch: eager, compiled, bf16
                          autocast, fp16 with a GradScaler
``host-sync``             no host synchronisation in a warmed step, eager and compiled: one
                          device; 2 processes over gloo with CUDA tensors; NCCL, one process
``memory``                a step's peak CUDA memory against plain PyTorch's
``dispatch-profile``      where an eager call's time goes, on CUDA and on the CPU (measures)
``bench``                 benchmark rows (a), (b) and (h), as ratios to plain PyTorch and to
                          ``torch.compile``
========================  =====================================================================

Without CUDA the same command runs what it can on CPU devices, names every CUDA-only part
(or piece of a part) it skipped, and exits 0 when everything it ran passed: CI runs it
that way (``--quick``), so that it does not rot between GPU sessions.

Run it as ``python -m torchpmap.bench.gpu_check`` (``make gpu-check``); ``--help`` lists
the options.
"""
