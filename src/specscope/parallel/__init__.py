"""Tensor parallelism over torch.distributed: the group and its timed collectives
(group.py), which slice of each weight a rank holds (shard.py), the parallel modules
(layers.py), the control channel rank 0 drives the others through (channel.py), and
starting the ranks (launch.py). See docs/tensor-parallel.md."""
