"""Tensor and pipeline parallelism: which part of the model each rank holds (``layout.py``, plain
data the load-time plan reads), and the process groups that join the ranks at run time
(``groups.py``: torch.distributed, with a shared-memory all-reduce between the ranks of one host,
``shm.py``)."""
