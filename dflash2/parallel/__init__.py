"""Tensor and pipeline parallelism over torch.distributed (DESIGN.md decision 8): one model split over ranks.

    config.py           ParallelConfig: sizes, executor, timeouts
    groups.py           RankGroups: a rank's place and its process groups (NCCL or gloo; a gloo control group)
    shard.py            a whole loaded model cut down to one rank's part; each rank's KV layout
    layers.py           the wrappers that sum or gather over the tensor group
    runner.py           DriverRunner (rank 0: the engine's) and WorkerRunner (the others)
    messages.py         what rank 0 tells the others: Load, Profile, Serve, Step, Stop
    executor.py         rank 0's side: starts, drives, watches and stops the others
    worker.py           the other ranks' loop (both executors)
    process_workers.py  the mp executor's processes;  ray_workers.py  the Ray executor's actors
"""
