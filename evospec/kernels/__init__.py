"""Device kernels of the vocabulary path, each with a torch reference, and GPU plumbing.

Owns: the row gather into the packed LM-head buffer (``gather.py``), slot planning of fixed
shape for that buffer (``slots.py``), NanoSpec's window push on the device (``window.py``),
the backend choice Triton / Triton interpreter / torch (``dispatch.py``), copy and side CUDA
streams with their events (``streams.py``) and bucketed CUDA-graph replay (``graphs.py``).
It knows tensors only: no policies, no models, no decode loop. On a CPU every entry point
runs its torch reference or does nothing, with the same results.
"""
