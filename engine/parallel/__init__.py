"""Tensor parallelism: the target split over ranks (`shard`), the ranks' group and collectives
(`group`), and rank 0's handle on the other ranks' processes (`workers`)."""
